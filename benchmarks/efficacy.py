"""Arms compared on held-out scores: each arm a config run through the CLI for a budget of training minutes, on one
or more seeds, from a shared start. One JSON line per arm and seed.

An arm is the base config (`--config`, with shared overlays) and its own overlay (`--arms`, files in `configs/arms/`),
parsed by `cli.py`'s own parser: every setting is a config key, and this script adds only what is its own: the clock,
the arms and seeds, the shared start, the held-out test before and after, and the JSON line. Extra arguments go to
every run's command line as they are (`--data.val_pairs 32`).

The start is a checkpoint or model folder (`--start`), or a warm start built per seed by a run of its own
(`--warm OVERLAY`: the base config and that overlay, ended at its last supervised step), kept in `--warm-dir` under a
digest of its configs, arguments and seed, so later processes reuse it; the start's test is kept there too, shared by
arms that differ only in how they train (`TRAINING_ONLY`). From the start's weights each arm tests the
held-out pairs at every evaluation length with greedy answers and `--samples` sampled ones (pass@1 and pass@k: an
answer counts from the schedule's success level; at `--sample-lengths` only, when given), trains until `--minutes`
of training (evaluations left out; `--clock cpu` counts this process's CPU time; the minutes count GRPO steps, or
supervised ones in an arm of supervised steps only) or until its curriculum stops, then tests again. The line's
`fit_minutes` counts the whole fit on the same clock: a warm start inside the run, GRPO and every held-out check.

An arm may span sessions: SIGTERM (`kill PID`) pauses it, saving its run's `last.ckpt` with the clock's minutes, curve
and the start's test; the same command with `--resume` goes on from there (one arm and one seed).

    python benchmarks/efficacy.py --config configs/smollm2.yaml --warm configs/arms/smollm2-warm-10w.yaml \
        --arms configs/arms/smollm2-grpo-10w.yaml configs/arms/smollm2-sft-10w.yaml --seeds 0 1 2 --minutes 30
    python benchmarks/efficacy.py --config configs/curriculum.yaml --arms configs/arms/tiny-adaptive.yaml \
        --start WARM.ckpt --minutes 90 --clock cpu --threads 1 --out benchmarks/results/tiny-climb.jsonl

`benchmarks/efficacy_table.py` prints a file of these lines as a table.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import harness
import lightning as L
import torch
import yaml
from clock import Clock, binned, held_out_scores
from provenance import STARTED_AT, provenance

from cli import main
from interleave_data.atomic import replacing
from interleave_model.evaluation.evaluator import Evaluator

# each stream's accuracy and the share of answers that copy one fragment: the alignment score pays such a copy 0.5, so
# a score near 0.5 is read with them
MEASURES = ("score", "score_stderr", "exact_match", "a_accuracy", "b_accuracy", "copy_share")
BATCH_KEYS = ("words", "reward", "success", "pass_at_g", "zero_std", "identical")


def tested(module) -> dict[str, dict[str, float]]:
    """The last test's rows as `{"<N>w": {score, score_stderr, exact_match, a_accuracy, b_accuracy, copy_share,
    pass@k...}}`."""
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


class EndOfWarmStart(L.Callback):
    """Ends a warm start's run after its last supervised batch, before any GRPO step."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not trainer.datamodule.curriculum.warm_start(trainer.datamodule.batches_run):
            trainer.should_stop = True


# Arguments that say where a run writes and how it shows progress, never what it learns: the warm start trains in a
# folder of its own whatever they say, so arms with their own run folders share it.
NOT_SHAPING = ("--trainer.default_root_dir", "--trainer.enable_progress_bar")


def shaping_arguments(extra: list[str]) -> list[str]:
    """`extra` without the `NOT_SHAPING` options and their values (`--key value` or `--key=value`)."""
    kept, skip = [], False
    for argument in extra:
        if skip:
            skip = False
        elif argument in NOT_SHAPING:
            skip = True
        elif argument.split("=", 1)[0] not in NOT_SHAPING:
            kept.append(argument)
    return kept


def digest_of(shaping: dict) -> str:
    """A short digest of what shapes a kept result (a warm start, a start's test): its file's name."""
    return hashlib.sha256(json.dumps(shaping).encode()).hexdigest()[:12]


def warm_start(overlay: str, configs: list[str], extra: list[str], seed: int, folder: Path) -> tuple[str, dict]:
    """The warm start of `seed`: the base `configs` and `overlay` trained to the end of their supervised steps, saved
    in `folder` under a digest of everything that shapes it; reused when there. Its checkpoint and what it reached."""
    files = [*configs, overlay]
    shaping = {"configs": [Path(f).read_text() for f in files], "extra": shaping_arguments(extra), "seed": seed}
    digest = digest_of(shaping)
    path = folder / f"warm-{Path(overlay).stem}-{seed}-{digest}.ckpt"
    if not path.exists():
        with tempfile.TemporaryDirectory() as runs:
            cli = main(["fit", *(a for f in files for a in ("--config", f)), *seeded(seed), *extra,
                        "--trainer.default_root_dir", runs], callbacks=[EndOfWarmStart()])  # fmt: skip
            reached = {"steps": cli.trainer.global_step, "held_out": held_out_scores(cli.trainer.callback_metrics, 4)}
            with replacing(path.with_suffix(".json")) as tmp:
                tmp.write_text(json.dumps(reached))
            with replacing(path) as tmp:  # the checkpoint last: a kill leaves no warm start that looks whole
                cli.trainer.save_checkpoint(tmp, weights_only=False)  # the full state
    return str(path), {"warm": overlay, "checkpoint": str(path)} | json.loads(path.with_suffix(".json").read_text())


# An arm overlay's settings that shape its training only, never its start's test (the held-out pairs, the lengths,
# the answers, and the success level pass@k counts from): arms that differ in these alone share the start's test.
TRAINING_ONLY = {
    "trainer": ("logger", "max_steps", "val_check_interval"),
    "model": ("optimization", "loss", "kl"),
    "data": ("replay_fraction",),
    "data.curriculum": ("patience", "min_steps", "window", "val_threshold", "stop_when_done", "on_collapse"),
    "data.curriculum.adaptive": ("target", "step"),
}


def test_shaping(overlay: dict) -> dict:
    """`overlay` (a parsed config) without its `TRAINING_ONLY` settings."""
    kept = copy.deepcopy(overlay)
    for group, keys in TRAINING_ONLY.items():
        node = kept
        for part in group.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        for key in keys if isinstance(node, dict) else ():
            node.pop(key, None)
    return kept


def start_test(args, configs: list[str], start: str | None, seed: int, extra: list[str], run) -> dict:
    """The start's test (`run()`), kept in `--warm-dir` under a digest of everything that shapes it and reused there,
    with the commit that ran it: an arm's own training settings (`TRAINING_ONLY`) are left out of the digest. Only a
    warm start's test is kept: its path names its digest, where a `--start` path may hold other weights later."""
    if not (args.warm and args.warm_dir):
        return {"scores": run(), "commit": STARTED_AT}
    shaping = {"start": start, "seed": seed, "configs": [Path(f).read_text() for f in configs[:-1]],
               "arm": test_shaping(yaml.safe_load(Path(configs[-1]).read_text()) or {}),
               "extra": shaping_arguments(extra), "test_pairs": args.test_pairs, "samples": args.samples,
               "sample_lengths": args.sample_lengths}  # fmt: skip
    digest = digest_of(shaping)
    path = Path(args.warm_dir) / f"start-test-{seed}-{digest}.json"
    if not path.exists():
        with replacing(path) as tmp:
            tmp.write_text(json.dumps({"scores": run(), "commit": STARTED_AT}))
    return json.loads(path.read_text())


def seeded(seed: int) -> list[str]:
    return ["--seed_everything", str(seed), "--data.seed", str(seed)]


def run_arm(args, configs: list[str], start: str | None, seed: int, extra: list[str]) -> dict:
    """One arm (`configs`, its overlay last) on `seed` from `start`: tested, trained, tested again; its line."""
    common = [a for c in configs for a in ("--config", c)][:-2]  # the base, then the start's, then the arm's overlay
    common += seeded(seed) + ["--data.test_pairs", str(args.test_pairs)]
    if start:
        common += ["--model.base.init_from", start, "--data.sft_steps", "0"]
    common += ["--config", configs[-1], *extra]
    sampling = TestSampling(args.samples, args.sample_lengths)

    clock = Clock(args.minutes, cpu=args.clock == "cpu", stop_file=args.stop_file)
    if not args.resume:  # the start's test, kept in the clock's state: a resumed arm finds it in its checkpoint
        test = start_test(args, configs, start, seed, extra,
                          lambda: tested(main(["test", *common], callbacks=[sampling]).model))  # fmt: skip
        clock.extra["test_start"], clock.extra["test_start_commit"] = test["scores"], test["commit"]
    cli = main(["fit", *common, *(["--ckpt_path", "last"] if args.resume else [])], callbacks=[clock, sampling])
    module, dm, curriculum = cli.model, cli.datamodule, cli.datamodule.curriculum
    end_training = {"steps": cli.trainer.global_step, "training_minutes": round(clock.seconds() / 60, 1),
                    "fit_minutes": round(clock.fit_seconds() / 60, 1)}  # fmt: skip
    cli.trainer.test(module, datamodule=dm, verbose=False)
    return {
        "benchmark": "efficacy", "arm": Path(configs[-1]).stem, "configs": configs, "start": start, "seed": seed,
        "minutes": args.minutes, "clock": args.clock, **end_training, "supervised": clock.supervised,
        "stopped_early": clock.stopped_early,
        "eval_s": round(clock.evaluating, 1), "length_end": curriculum.length, "milestone": curriculum.stage_words,
        "done": curriculum.done, "stopped": curriculum.state.stopped,
        "transitions": [{k: h[k] for k in ("kind", "from_words", "to_words", "global_step")}
                        for h in curriculum.state.history],
        "test_start": clock.extra["test_start"], "test_start_commit": clock.extra.get("test_start_commit"),
        "test_end": tested(module), "curve": clock.curve,
        "sample_lengths": args.sample_lengths, "bin_batches": args.bin, **binned(clock.batches, args.bin, BATCH_KEYS),
    }  # fmt: skip


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", required=True, help="base config, then shared overlays, in order")
    parser.add_argument("--arms", nargs="+", default=None, help="one overlay per arm; default: the configs are one arm")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seed_everything and data.seed, each")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--start", default=None, help="weights to start from: a .ckpt or model folder; no warm-start")
    start.add_argument("--warm", default=None, help="an overlay whose run, per seed, makes the start (supervised)")
    parser.add_argument("--warm-dir", default=None, help="keep warm starts and start tests here (default: a temp dir)")
    parser.add_argument("--minutes", type=float, default=90.0, help="training budget, evaluations left out")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stop-file", default=None, help="the arm ends when this file appears, is tested; no more run")
    parser.add_argument("--resume", action="store_true", help="go on with an arm SIGTERM paused, from its last.ckpt")
    parser.add_argument("--test-pairs", type=int, default=128, help="held-out test pairs per evaluation length")
    parser.add_argument("--samples", type=int, default=8, help="sampled answers per test prompt, for pass@k")
    parser.add_argument("--sample-lengths", type=int, nargs="+", default=None, help="sample only at these lengths")
    parser.add_argument("--bin", type=int, default=50, help="training batches per reported bin")
    parser.add_argument("--out", default=None, help="append the JSON lines to this file as well")
    args, extra = parser.parse_known_args()
    arms = [[*args.config, arm] for arm in args.arms] if args.arms else [args.config]
    if args.resume and len(arms) * len(args.seeds) > 1:
        parser.error("--resume goes on with one arm on one seed")
    torch.set_num_threads(args.threads)
    context = provenance(args.threads)
    sys.argv = sys.argv[:1]  # the CLI reads its arguments from `main`'s, not from this command line
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            start, warm = args.start, {}
            if args.warm:
                start, warm = warm_start(args.warm, args.config, extra, seed, Path(args.warm_dir or scratch))
            for configs in arms:
                line = run_arm(args, configs, start, seed, extra) | {"warm_start": warm} | context
                harness.emit(line, args.out)
                if line["stopped_early"]:
                    return


if __name__ == "__main__":
    main_()
