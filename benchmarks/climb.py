"""One arm of the curriculum's evidence: a config run through the CLI for a budget of GRPO minutes. One JSON line.

The arm is the config, base and overlays (`configs/arms/`), parsed by `cli.py`'s own parser: this script adds only
the clock, the start, the held-out test before and after, and the JSON line. From the start's weights (`--start`, a
warm start's checkpoint or model folder; no warm-start steps then), it tests the held-out pairs at every evaluation
length with greedy answers and `--samples` sampled ones (pass@1 and pass@k: an answer counts from the schedule's
success level), trains until `--minutes` of GRPO (evaluations left out; `--clock cpu` counts this process's CPU
time) or until the curriculum stops, then tests again. Extra arguments go to the CLI as they are.

    python benchmarks/climb.py --config configs/curriculum.yaml --config configs/arms/tiny-adaptive.yaml \
        --start WARM.ckpt --minutes 90 --clock cpu --threads 1 --out benchmarks/results/tiny-climb.jsonl

The warm start is a run of its own (`configs/arms/tiny-warm.yaml` says how); its checkpoint is shared by the arms.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import lightning as L
import torch
from provenance import provenance

sys.path.insert(0, str(Path(__file__).parents[1]))  # cli.py, at the checkout's root

from cli import main  # noqa: E402
from interleave_model.evaluation.evaluator import Evaluator  # noqa: E402
from interleave_model.run.callbacks import group_counts  # noqa: E402

MEASURES = ("score", "score_stderr", "exact_match")


class Clock(L.Callback):
    """Ends GRPO after `minutes` of it (evaluations left out) or when `stop_file` appears; records each GRPO batch's
    length and group counts and each held-out evaluation."""

    def __init__(self, minutes: float, cpu: bool, stop_file: str | None):
        self.budget, self.stop_file = minutes * 60, stop_file
        self.now = time.process_time if cpu else time.perf_counter
        self.started: float | None = None
        self.evaluating, self._eval_began = 0.0, None
        self.stopped_early = False
        self.batches: list[dict] = []
        self.curve: list[dict] = []

    def seconds(self) -> float:
        return 0.0 if self.started is None else self.now() - self.started - self.evaluating

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.started is None and batch["phase"] == "grpo":
            self.started = self.now()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        record = outputs.get("record") if isinstance(outputs, dict) else None
        curriculum = trainer.datamodule.curriculum
        if record is not None:
            words = max(record.n_words)
            c = group_counts(record, words, curriculum.success_level)
            self.batches.append({
                "words": words, "reward": c["reward"] / c["rows"], "success": c["succeeded"] / c["rows"],
                "pass_at_g": c["passed"] / c["groups"], "zero_std": c["flat"] / c["groups"],
                "length": curriculum.length,
            })  # fmt: skip
        if self.started is not None and self.seconds() >= self.budget:
            trainer.should_stop = True
        if self.stop_file and os.path.exists(self.stop_file):
            trainer.should_stop = self.stopped_early = True

    def on_validation_start(self, trainer, pl_module):
        self._eval_began = self.now()

    def on_validation_end(self, trainer, pl_module):
        if self.started is not None and self._eval_began is not None:
            self.evaluating += self.now() - self._eval_began
        curriculum = trainer.datamodule.curriculum
        scores = {k.split("_")[-1]: round(float(v), 3) for k, v in trainer.callback_metrics.items()
                  if k.startswith("val/alignment_")}  # fmt: skip
        point = {"step": trainer.global_step, "s": round(self.seconds(), 1), "length": curriculum.length} | scores
        self.curve.append(point)
        print(f"climb: {point}", file=sys.stderr, flush=True)


def tested(module) -> dict[str, dict[str, float]]:
    """The last test's rows as `{"<N>w": {score, score_stderr, exact_match, pass@k...}}`."""
    rows = module.eval_results["lengths"]
    return {
        f"{row['n_words']}w": {k: round(v, 4) for k, v in row.items() if k in MEASURES or k.startswith("pass@")}
        for row in rows
    }


def binned(batches: list[dict], size: int) -> dict[str, list[float]]:
    bins = [batches[i : i + size] for i in range(0, len(batches), size)]
    keys = ("words", "reward", "success", "pass_at_g", "zero_std")
    return {key: [round(sum(b[key] for b in chunk) / len(chunk), 3) for chunk in bins] for key in keys}


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", required=True, help="base config, then overlays, in order")
    parser.add_argument("--start", default=None, help="weights to start from: a .ckpt or model folder; no warm-start")
    parser.add_argument("--seed", type=int, default=0, help="seed_everything and data.seed")
    parser.add_argument("--minutes", type=float, default=90.0, help="GRPO budget, evaluations left out")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stop-file", default=None, help="the arm ends when this file appears, then is tested")
    parser.add_argument("--test-pairs", type=int, default=128, help="held-out test pairs per evaluation length")
    parser.add_argument("--samples", type=int, default=8, help="sampled answers per test prompt, for pass@k")
    parser.add_argument("--bin", type=int, default=50, help="GRPO batches per reported bin")
    parser.add_argument("--out", default=None, help="append the JSON line to this file as well")
    args, rest = parser.parse_known_args()
    torch.set_num_threads(args.threads)
    context = provenance(args.threads)
    sys.argv = sys.argv[:1]  # the CLI reads its arguments from `main`'s, not from this command line
    common = [a for c in args.config for a in ("--config", c)]
    common += ["--seed_everything", str(args.seed), "--data.seed", str(args.seed)]
    common += ["--data.test_pairs", str(args.test_pairs)]
    if args.start:
        common += ["--model.base.init_from", args.start, "--data.sft_steps", "0"]
    common += rest

    clock = Clock(args.minutes, args.clock == "cpu", args.stop_file)
    cli = main(["fit", *common], callbacks=[clock])
    module, dm, curriculum = cli.model, cli.datamodule, cli.datamodule.curriculum
    end_training = {"steps": cli.trainer.global_step, "training_minutes": round(clock.seconds() / 60, 1)}

    settings = replace(module.evaluation, num_samples=args.samples, temperature=module.temperature,
                       pass_k=[1, args.samples], pass_threshold=curriculum.success_level)  # fmt: skip
    module.evaluator = Evaluator(settings, module.evaluator.seed).to(module.device)
    cli.trainer.test(module, datamodule=dm, verbose=False)
    end = tested(module)

    start_cli = main(["test", *common, f"--model.evaluation.num_samples={args.samples}",
                      f"--model.evaluation.temperature={settings.temperature}",
                      f"--model.evaluation.pass_k=[1, {args.samples}]",
                      f"--model.evaluation.pass_threshold={settings.pass_threshold}"])  # fmt: skip
    start = tested(start_cli.model)

    out = {
        "benchmark": "climb", "configs": args.config, "start": args.start, "seed": args.seed,
        "minutes": args.minutes, "clock": args.clock, **end_training, "stopped_early": clock.stopped_early,
        "eval_s": round(clock.evaluating, 1), "length_end": curriculum.length, "milestone": curriculum.stage_words,
        "done": curriculum.done, "stopped": curriculum.state.stopped,
        "transitions": [{k: h[k] for k in ("kind", "from_words", "to_words", "global_step")}
                        for h in curriculum.state.history],
        "test_start": start, "test_end": end, "curve": clock.curve,
        "bin_batches": args.bin, **binned(clock.batches, args.bin),
    } | context  # fmt: skip
    line = json.dumps(out)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main_()
