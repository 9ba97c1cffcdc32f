"""``python -m interleave_data stats | generate``: how many texts reach each stage, and the dataset folder."""

import argparse
import sys
from collections.abc import Sequence

from interleave_data.corpus import DEFAULT_SOURCE, Corpus, CorpusError, load_corpus
from interleave_data.curriculum_types import check_lengths
from interleave_data.folder import write_dataset
from interleave_data.pairs import SPLITS, build_dataset, check_fractions, split_texts, usable_counts

DEFAULT_STAGES = (10, 25, 50, 100, 200, 500)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit code (2 on bad input, with one line on stderr)."""
    args = _parser().parse_args(argv)
    try:
        args.command(args)
    except (CorpusError, OSError) as e:
        print(f"interleave_data: error: {e}", file=sys.stderr)
        return 2
    return 0


def stats(args: argparse.Namespace) -> None:
    """Prints, per stage, how many texts reach its length in each split, and warns where a split has too few."""
    stages = check_lengths(args.stages, "--stages")
    corpus = load_corpus(args.corpus)
    by_split = split_texts(corpus.texts, check_fractions(args.split_fractions), args.seed)
    print(_summary(args, corpus, by_split))
    counts = usable_counts(by_split, stages)
    rows = [[n, corpus.count_at_least(n), *(counts[n][split] for split in SPLITS)] for n in stages]
    print(_table(["words", "texts", *SPLITS], rows))
    for n in stages:
        for split in SPLITS:
            if counts[n][split] < 2:
                print(
                    f"warning: stage {n} words: split {split!r} has {counts[n][split]} text(s) of >= {n} words "
                    "(need 2); add longer texts, e.g. --corpus pydoc_data.topics more_texts.jsonl"
                )


def generate(args: argparse.Namespace) -> None:
    """Builds every stage and split, writes the folder all at once, and prints what it wrote."""
    stages = check_lengths(args.stages, "--stages")
    fractions = check_fractions(args.split_fractions)
    corpus = load_corpus(args.corpus)
    pairs = {"train": args.train_pairs, "val": args.val_pairs, "test": args.test_pairs}
    examples = build_dataset(corpus.texts, {split: stages for split in SPLITS}, pairs, fractions, args.seed)
    by_split = split_texts(corpus.texts, fractions, args.seed)
    counts = usable_counts(by_split, stages)
    summary = {
        "corpus": args.corpus or [DEFAULT_SOURCE],
        "seed": args.seed,
        "split_fractions": list(fractions),
        "texts": {
            "total": len(corpus.texts),
            "dropped_empty": corpus.dropped_empty,
            "dropped_duplicates": corpus.dropped_duplicates,
            **{split: len(by_split[split]) for split in SPLITS},
        },
        "stages": [
            {
                "n_words": n,
                "pairs": {split: len(examples[n, split]) for split in SPLITS},
                "usable_texts": counts[n],
            }
            for n in stages
        ],
    }
    write_dataset(args.output_dir, examples, summary, overwrite=args.overwrite)
    print(f"wrote {args.output_dir}")
    print(_summary(args, corpus, by_split))
    rows = [
        [n, *(len(examples[n, split]) for split in SPLITS), *(counts[n][split] for split in SPLITS)] for n in stages
    ]
    print(_table(["words", *(f"{split} pairs" for split in SPLITS), *(f"{split} texts" for split in SPLITS)], rows))


def _summary(args: argparse.Namespace, corpus: Corpus, by_split: dict) -> str:
    sizes = ", ".join(f"{split} {len(by_split[split])}" for split in SPLITS)
    return (
        f"corpus: {' '.join(args.corpus or [DEFAULT_SOURCE + ' (default)'])}\n"
        f"texts: {len(corpus.texts)} (dropped {corpus.dropped_empty} empty, {corpus.dropped_duplicates} duplicate); "
        f"split by text with seed {args.seed}: {sizes}"
    )


def _table(header: list[str], rows: list[list]) -> str:
    cells = [header, *[[str(cell) for cell in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in cells)


def _positive_int(value: str) -> int:
    if _to_int(value) is None or _to_int(value) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return int(value)


def _count(value: str) -> int:
    if _to_int(value) is None or _to_int(value) < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value!r}")
    return int(value)


def _to_int(value: str) -> int | None:
    try:
        return int(value)
    except ValueError:
        return None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # One line, no usage block: bad input must read as a single clear error.
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m interleave_data", description=__doc__)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    for name, command, help_text in [
        ("stats", stats, "how many texts reach each stage length, per split"),
        ("generate", generate, "write <N>words/{train,val,test}.jsonl and stats.json"),
    ]:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(command=command)
        sub.add_argument(
            "--corpus",
            nargs="+",
            action="extend",
            metavar="SRC",
            help=f"JSON / JSONL / .txt file, folder, saved HF dataset or hub name; several merge (default: "
            f"{DEFAULT_SOURCE}, which may also be named to merge it with others)",
        )
        sub.add_argument("--stages", nargs="+", type=_positive_int, default=list(DEFAULT_STAGES), metavar="N")
        sub.add_argument("--seed", type=int, default=0)
        sub.add_argument("--split-fractions", nargs=3, type=float, default=[0.8, 0.1, 0.1], metavar="F")
        if name == "generate":
            sub.add_argument("--output-dir", required=True)
            sub.add_argument("--train-pairs", type=_count, default=1000, metavar="N")
            sub.add_argument("--val-pairs", type=_count, default=32, metavar="N")
            sub.add_argument("--test-pairs", type=_count, default=32, metavar="N")
            sub.add_argument("--overwrite", action="store_true", help="replace an output folder that holds files")
    return parser
