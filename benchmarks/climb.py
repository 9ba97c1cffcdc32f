"""One arm of the curriculum's evidence: a config run through the CLI for a budget of GRPO minutes. One JSON line.

The arm is the config, base and overlays (`configs/arms/`), parsed by `cli.py`'s own parser: this script adds only
the clock, the start, the held-out test before and after, and the JSON line. From the start's weights (`--start`, a
warm start's checkpoint or model folder; no warm-start steps then), it tests the held-out pairs at every evaluation
length with greedy answers and `--samples` sampled ones (pass@1 and pass@k: an answer counts from the schedule's
success level; at `--sample-lengths` only, when given), trains until `--minutes` of GRPO (evaluations left out;
`--clock cpu` counts this process's CPU time) or until the curriculum stops, then tests again. Extra arguments go to
the CLI as they are.

An arm may span sessions: SIGTERM (`kill PID`) pauses it, saving its run's `last.ckpt` with the clock's minutes, curve
and the start's test; the same command with `--resume` goes on from there.

    python benchmarks/climb.py --config configs/curriculum.yaml --config configs/arms/tiny-adaptive.yaml \
        --start WARM.ckpt --minutes 90 --clock cpu --threads 1 --out benchmarks/results/tiny-climb.jsonl

The warm start is a run of its own (`configs/arms/tiny-warm.yaml` says how); its checkpoint is shared by the arms.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import lightning as L
import torch
from clock import Clock, binned
from provenance import provenance

from cli import main
from interleave_model.evaluation.evaluator import Evaluator

MEASURES = ("score", "score_stderr", "exact_match")
BATCH_KEYS = ("words", "reward", "success", "pass_at_g", "zero_std", "identical")


def tested(module) -> dict[str, dict[str, float]]:
    """The last test's rows as `{"<N>w": {score, score_stderr, exact_match, pass@k...}}`."""
    rows = module.eval_results["lengths"]
    return {
        f"{row['n_words']}w": {k: round(v, 4) for k, v in row.items() if k in MEASURES or k.startswith("pass@")}
        for row in rows
    }


class TestSampling(L.Callback):
    """Tests with greedy answers and `samples` sampled ones (at `lengths` only, unless None) at the rollout's configured
    temperature, an answer counting for pass@k from the schedule's success level: the same settings before and after
    training."""

    def __init__(self, samples: int, lengths: list[int] | None):
        self.samples, self.lengths = samples, lengths

    def on_test_start(self, trainer, pl_module):
        success = trainer.datamodule.curriculum.success_level
        settings = replace(pl_module.evaluation, num_samples=self.samples, temperature=pl_module.sampling.temperature,
                           pass_k=[1, self.samples], pass_threshold=success, sample_lengths=self.lengths)  # fmt: skip
        pl_module.evaluator = Evaluator(settings, pl_module.evaluator.seed).to(pl_module.device)


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", required=True, help="base config, then overlays, in order")
    parser.add_argument("--start", default=None, help="weights to start from: a .ckpt or model folder; no warm-start")
    parser.add_argument("--seed", type=int, default=0, help="seed_everything and data.seed")
    parser.add_argument("--minutes", type=float, default=90.0, help="GRPO budget, evaluations left out")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stop-file", default=None, help="the arm ends when this file appears, then is tested")
    parser.add_argument("--resume", action="store_true", help="go on with an arm SIGTERM paused, from its last.ckpt")
    parser.add_argument("--test-pairs", type=int, default=128, help="held-out test pairs per evaluation length")
    parser.add_argument("--samples", type=int, default=8, help="sampled answers per test prompt, for pass@k")
    parser.add_argument("--sample-lengths", type=int, nargs="+", default=None, help="sample only at these lengths")
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
    sampling = TestSampling(args.samples, args.sample_lengths)

    clock = Clock(args.minutes, cpu=args.clock == "cpu", stop_file=args.stop_file)
    if not args.resume:  # the start's test, kept in the clock's state: a resumed arm finds it in its checkpoint
        clock.extra["test_start"] = tested(main(["test", *common], callbacks=[sampling]).model)
    cli = main(["fit", *common, *(["--ckpt_path", "last"] if args.resume else [])], callbacks=[clock, sampling])
    module, dm, curriculum = cli.model, cli.datamodule, cli.datamodule.curriculum
    end_training = {"steps": cli.trainer.global_step, "training_minutes": round(clock.seconds() / 60, 1)}
    cli.trainer.test(module, datamodule=dm, verbose=False)

    out = {
        "benchmark": "climb", "configs": args.config, "start": args.start, "seed": args.seed,
        "minutes": args.minutes, "clock": args.clock, **end_training, "stopped_early": clock.stopped_early,
        "eval_s": round(clock.evaluating, 1), "length_end": curriculum.length, "milestone": curriculum.stage_words,
        "done": curriculum.done, "stopped": curriculum.state.stopped,
        "transitions": [{k: h[k] for k in ("kind", "from_words", "to_words", "global_step")}
                        for h in curriculum.state.history],
        "test_start": clock.extra["test_start"], "test_end": tested(module), "curve": clock.curve,
        "sample_lengths": args.sample_lengths, "bin_batches": args.bin, **binned(clock.batches, args.bin, BATCH_KEYS),
    } | context  # fmt: skip
    line = json.dumps(out)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main_()
