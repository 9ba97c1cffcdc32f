"""The length-generalisation curve of a start: at every length, the greedy answers' score (with its standard error)
and exact match, and the share of sampled answers that succeed (pass@1 from the success level, pass@k). One JSON line
per start, seed and length, with the command and commit.

A curriculum moves only where answers one step past the training length sometimes succeed: this is the number a
route to length generalisation is screened on. The start is a checkpoint or model folder (`--start`) or, per seed, a
warm start built by `--warm OVERLAY` on top of the `--config` files (as `efficacy.py` builds and keeps them):

    python benchmarks/length_curve.py --config configs/curriculum.yaml --config configs/arms/tiny-warm.yaml \
        --warm configs/arms/tiny-warm-coupled.yaml --warm-dir warm --seeds 0 1 2 \
        --lengths 8 10 11 12 13 15 20 25 --out benchmarks/results/length-curve.jsonl
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import harness
import torch
from efficacy import TestSampling, seeded, warm_start
from provenance import provenance

from cli import main


def curve_lines(rows: list[dict], samples: int) -> list[dict]:
    """The test's rows (`module.eval_results["lengths"]`) as one record per length: `score` and `score_stderr` of
    the greedy answers, `exact_match`, `success` (pass@1: the share of sampled answers at or above the success level)
    with `success_stderr_bound` (sqrt(p (1 - p) / pairs), a bound on the standard error over prompts) and pass@k."""
    lines = []
    for row in rows:
        success = row.get("pass@1", math.nan)
        bound = math.sqrt(success * (1 - success) / row["pairs"]) if not math.isnan(success) else math.nan
        line = {"n_words": row["n_words"], "pairs": row["pairs"], "score": row["score"],
                "score_stderr": row["score_stderr"], "exact_match": row["exact_match"], "success": success,
                "success_stderr_bound": bound, f"pass@{samples}": row.get(f"pass@{samples}", math.nan)}  # fmt: skip
        lines.append({key: round(value, 4) if isinstance(value, float) else value for key, value in line.items()})
    return lines


def length_curve(configs: list[str], start: str | None, seed: int, lengths: list[int], pairs: int, samples: int,
                 extra: list[str]) -> list[dict]:  # fmt: skip
    """Test `start` (its weights; None: the configs' own model) at `lengths` on `pairs` held-out pairs each."""
    command = [a for c in configs for a in ("--config", c)] + seeded(seed)
    command += ["--data.eval_stages", str(lengths), "--data.test_pairs", str(pairs), *extra]
    if start:
        command += ["--model.base.init_from", start]
    sampling = TestSampling(samples, None)
    module = main(["test", *command], callbacks=[sampling]).model
    return curve_lines(module.eval_results["lengths"], samples)


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", required=True, help="base config, then shared overlays, in order")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--start", default=None, help="weights to test: a .ckpt or model folder")
    start.add_argument("--warm", default=None, help="an overlay whose run, per seed, makes the start (supervised)")
    parser.add_argument("--warm-dir", default=None, help="keep warm starts here (default: a temp dir)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seed_everything and data.seed, each")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8, 10, 11, 12, 13, 15, 20, 25])
    parser.add_argument("--pairs", type=int, default=128, help="held-out test pairs per length")
    parser.add_argument("--samples", type=int, default=8, help="sampled answers per prompt, for the success share")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="append the JSON lines to this file as well")
    args, extra = parser.parse_known_args()
    torch.set_num_threads(args.threads)
    context = provenance(args.threads)
    sys.argv = sys.argv[:1]  # the CLI reads its arguments from `main`'s, not from this command line
    configs = list(args.config) + ([args.warm] if args.warm else [])
    route = Path(args.warm).stem if args.warm else None
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            start, warm = args.start, {}
            if args.warm:
                start, warm = warm_start(args.warm, args.config, extra, seed, Path(args.warm_dir or scratch))
            for line in length_curve(configs, start, seed, args.lengths, args.pairs, args.samples, extra):
                harness.emit({"benchmark": "length_curve", "route": route, "start": start, "seed": seed, **line,
                              "samples": args.samples, "warm_start": warm} | context, args.out)  # fmt: skip


if __name__ == "__main__":
    main_()
