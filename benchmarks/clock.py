"""The benchmarks' one clock: a Lightning callback that ends training after a budget of minutes and records what the
arms are compared on (`efficacy.py`).

The budget counts training time: held-out evaluations are left out of it (they cost a real model as much as several
steps, and every arm is evaluated alike) and reported apart as `evaluating`. `cpu` counts this process's CPU seconds
instead of wall seconds: with one torch thread, a run's own work, whatever else shares the machine. The clock starts
at the first GRPO batch, or at the first batch in a run of supervised steps only (`data.sft_steps` >= its
`trainer.max_steps`).

Beside the budget it counts the whole fit's seconds (`fit_seconds`: a warm start inside the run, GRPO and every
held-out check), what a run of a shipped config costs end to end.

Its state (the seconds spent, the curve, the per-batch rows and whatever the benchmark keeps in `extra`) is saved in
the run's checkpoints, so an arm stopped by SIGTERM goes on with `--ckpt_path last` where its clock stood.
"""

from __future__ import annotations

import os
import sys
import time

import lightning as L

from interleave_model.evaluation.evaluator import logged_scores, metric_name
from interleave_model.run.callbacks import group_counts

# per GRPO batch, from what the module logged: how the samples hold the streams, and the update's gradient
SAMPLE_KEYS = ("a_accuracy", "b_accuracy", "length_ratio", "copy_share")
BATCH_KEYS = (*SAMPLE_KEYS, "grad_norm", "grad_clipped")
# per held-out evaluation, at the first evaluation length
HELD_OUT_KEYS = ("score_stderr", *SAMPLE_KEYS)


class Clock(L.Callback):
    """Ends training after `minutes` of it or when `stop_file` appears; records each GRPO batch's group counts at its
    longest length and each held-out evaluation's scores."""

    def __init__(self, minutes: float, cpu: bool = False, stop_file: str | None = None):
        self.budget, self.stop_file = minutes * 60, stop_file
        self.supervised = False  # a run of supervised steps only: their minutes count
        self.now = time.process_time if cpu else time.perf_counter
        self.spent = 0.0  # training seconds before this process (a resumed arm's)
        self.started: float | None = None  # when this process's first counted batch began
        self.evaluating = 0.0  # seconds of held-out evaluation while the clock ran, all processes
        self._evaluating_here = 0.0
        self._eval_began: float | None = None
        self.fit_spent = 0.0  # the whole fit's seconds before this process (a resumed arm's)
        self._fit_began: float | None = None
        self.stopped_early = False  # `stop_file` appeared: the arm ended before its budget
        self.batches: list[dict] = []
        self.curve: list[dict] = []
        self.extra: dict = {}  # the benchmark's own state, kept with the clock's (the start's test)

    def seconds(self) -> float:
        """Training seconds so far, evaluations left out."""
        here = 0.0 if self.started is None else self.now() - self.started - self._evaluating_here
        return self.spent + here

    def fit_seconds(self) -> float:
        """The whole fit's seconds so far, in every process: supervised and GRPO steps and held-out checks."""
        return self.fit_spent + (0.0 if self._fit_began is None else self.now() - self._fit_began)

    def state_dict(self) -> dict:
        return {"spent": self.seconds(), "evaluating": self.evaluating, "batches": self.batches, "curve": self.curve,
                "extra": self.extra, "fit": self.fit_seconds()}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.spent, self.evaluating = state["spent"], state["evaluating"]
        self.fit_spent, self._fit_began = state.get("fit", 0.0), self.now()  # a checkpoint from before it: 0
        self.batches, self.curve, self.extra = state["batches"], state["curve"], state["extra"]
        self.started, self._evaluating_here = None, 0.0

    def on_fit_start(self, trainer, pl_module):
        self.supervised = trainer.datamodule.sft_steps >= trainer.max_steps
        if self._fit_began is None:  # a resumed clock began counting when its state loaded
            self._fit_began = self.now()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.started is None and (batch["phase"] == "grpo" or self.supervised):
            self.started = self.now()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        record = outputs.get("record") if isinstance(outputs, dict) else None
        if record is not None:
            self.batches.append(batch_row(trainer, record))
        if self.started is not None and self.seconds() >= self.budget:
            trainer.should_stop = True
        if self.stop_file is not None and os.path.exists(self.stop_file):
            trainer.should_stop = self.stopped_early = True

    def on_validation_start(self, trainer, pl_module):
        self._eval_began = self.now()

    def on_validation_end(self, trainer, pl_module):
        if self.started is not None and self._eval_began is not None:
            took = self.now() - self._eval_began
            self.evaluating += took
            self._evaluating_here += took
        if trainer.sanity_checking:
            return
        logged = trainer.callback_metrics
        # a check of fit may run some lengths only: the others' logged scores are an earlier check's
        ran = {f"{row['n_words']}w" for row in pl_module.eval_results["lengths"]}
        scores = {length: score for length, score in held_out_scores(logged, digits=3).items() if length in ran}
        point = {"step": trainer.global_step, "s": round(self.seconds(), 1), "length": _length(trainer)} | scores
        if scores:  # how the first length's answers hold the two streams, and the score's standard error
            first = min(scores, key=lambda k: int(k.removesuffix("w")))
            names = {key: metric_name("val", key, int(first.removesuffix("w"))) for key in HELD_OUT_KEYS}
            point |= {key: round(float(logged[name]), 3) for key, name in names.items() if name in logged}
        self.curve.append(point)
        print(f"clock: {point}", file=sys.stderr, flush=True)


def held_out_scores(logged: dict, digits: int) -> dict[str, float]:
    """The last validation's alignment score at each length, `{"<N>w": score}`, from a trainer's logged metrics."""
    return {f"{n}w": round(score, digits) for n, score in logged_scores(logged).items()}


def batch_row(trainer, record) -> dict:
    """One GRPO batch at its longest length: the mean reward, the shares of successful samples, of groups holding one
    (pass@G), of zero-variance groups and of groups of one answer repeated, with what the module logged."""
    curriculum = trainer.datamodule.curriculum
    words = max(record.n_words)
    c = group_counts(record, words, curriculum.success_level)
    logged = trainer.callback_metrics
    return {
        "words": words, "length": _length(trainer), "reward": c["reward"] / c["rows"],
        "success": c["succeeded"] / c["rows"], "pass_at_g": c["passed"] / c["groups"],
        "zero_std": c["flat"] / c["groups"], "identical": c["identical"] / c["groups"],
        **{key: float(logged[f"train/{key}"]) for key in BATCH_KEYS if f"train/{key}" in logged},
    }  # fmt: skip


def binned(batches: list[dict], size: int, keys: tuple[str, ...]) -> dict[str, list[float]]:
    """Each key's mean over consecutive bins of `size` batches."""
    bins = [batches[i : i + size] for i in range(0, len(batches), size)]
    return {key: [round(sum(b[key] for b in chunk) / len(chunk), 3) for chunk in bins] for key in keys}


def _length(trainer) -> float:
    return trainer.datamodule.curriculum.length
