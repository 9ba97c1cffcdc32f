"""The dataset folder on disk: ``<N>words/{train,val,test}.jsonl`` per stage plus ``stats.json``."""

import json
from collections.abc import Mapping
from pathlib import Path

from interleave_data.atomic import replacing_dir
from interleave_data.corpus import CorpusError
from interleave_data.pairs import Example


def split_path(dataset_dir: str | Path, n_words: int, split: str) -> Path:
    """Where the examples of one stage and split live."""
    return Path(dataset_dir) / f"{n_words}words" / f"{split}.jsonl"


def write_dataset(
    output_dir: str | Path, examples: Mapping[tuple[int, str], list[Example]], stats: dict, overwrite: bool = False
) -> None:
    """Writes the dataset folder all at once: into a temporary folder next to it, swapped in at the end.

    Args:
        output_dir: Target folder; created if missing.
        examples: ``(n_words, split) -> examples``.
        stats: Written as ``stats.json``.
        overwrite: Replace a folder that already holds files.

    Raises:
        CorpusError: ``output_dir`` is a file, or holds files and ``overwrite`` is False.
    """
    target = Path(output_dir)
    if target.exists() and not target.is_dir():
        raise CorpusError(f"{target}: output path exists and is not a folder")
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise CorpusError(f"{target}: output folder is not empty; pass --overwrite to replace its contents")
    with replacing_dir(target, lambda folder: overwrite) as staging:
        for (n_words, split), rows in sorted(examples.items()):
            path = split_path(staging, n_words, split)
            path.parent.mkdir(exist_ok=True)
            path.write_text("".join(_json_line(example.to_dict()) for example in rows), encoding="utf-8")
        (staging / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def read_split(dataset_dir: str | Path, n_words: int, split: str) -> list[Example]:
    """Reads the examples of one stage and split from a dataset folder.

    Raises:
        CorpusError: The file is missing, or a line is not a valid example of this stage and split (file:line).
    """
    path = split_path(dataset_dir, n_words, split)
    if not path.is_file():
        raise CorpusError(
            f"{path}: missing; write it with python -m interleave_data generate --output-dir {dataset_dir} "
            f"--stages ... {n_words}"
        )
    examples = []
    lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines(): U+2028 may sit inside a JSON string
    for lineno, line in enumerate(lines, start=1):
        if not line:
            continue
        try:
            example = Example.from_dict(json.loads(line))
        except (json.JSONDecodeError, CorpusError, TypeError) as e:
            raise CorpusError(f"{path}:{lineno}: not a valid example: {e}") from None
        if example.n_words != n_words or example.split != split:
            raise CorpusError(f"{path}:{lineno}: example {example.id} is from {example.n_words}words/{example.split}")
        examples.append(example)
    return examples


def _json_line(row: dict) -> str:
    return json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n"
