"""What a run prints: quiet by default, one line per evaluation, and a summary at the end of fit / validate / test.

`LOGLEVEL` (a Python logging level name: DEBUG, INFO, WARNING) turns the quiet mode off: every message, warning and
progress bar of Lightning, transformers, datasets and vLLM comes back, at that level. Left unset, the known harmless
ones below are filtered, each for the reason given beside it, and vLLM says only its errors (`vllm_engine`).
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from pathlib import Path

import datasets
import lightning as L
import transformers
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from interleave_model.run import runs
from interleave_model.run.callbacks import CurriculumCallback
from interleave_model.run.writers import EvaluationReport
from interleave_model.runtime.compat import CompatRichProgressBar

# Python warnings filtered in quiet mode (regular expressions matched against the start of the message).
QUIET_WARNINGS = (
    # Lightning 2.6's own pytree helper calls an API torch >= 2.10 deprecates; nothing in this project to change
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # a resumed run writes on into its own checkpoints/ folder: that is the point, not a clash
    r"Checkpoint directory .* exists and is not empty",
    # the module optimizes by hand and a checkpoint holds the state after the step, with global_step counting
    # completed steps: exactly what an exact resume needs (module.py, tests/test_resume.py)
    r"Using ModelCheckpoint with manual optimization and every_n_train_steps",
    # a resumed run restores the frozen KL reference, kept in eval mode on purpose (no dropout in the reference)
    r"Found \d+ module\(s\) in eval mode at the start of training",
    # an evaluation of a checkpoint is a run of its own, with its own folder: the training run's is not reused
    r"The dirpath has changed from",
    # vLLM's kernel dispatcher (vllm/triton_utils) reads an attribute torch >= 2.10 deprecates, at every engine start
    r"`torch\.distributed\.reduce_op` is deprecated",
    # every value the module logs per epoch passes sync_dist=True; a one-device run beside vLLM's process group of one
    # is told to anyway, once per value (Lightning syncs only across several devices, and warns whenever a group exists)
    r"It is recommended to use `self\.log\('(val|test)/.*sync_dist=True\)` when logging on epoch level",
)

# Lightning info lines dropped in quiet mode (matched against the start of the message).
QUIET_INFO = (
    "GPU available:",  # device detection: the accelerator is in the run's config.yaml
    "TPU available:",
    "HPU available:",
    "LOCAL_RANK:",  # CUDA_VISIBLE_DEVICES per rank, a debugging aid
    "💡 Tip:",  # an advertisement for a hosted service
    "Seed set to",  # the seed is in the run's config.yaml
    "You are using a CUDA device",  # the float32 matmul precision tip: the GPU configs compute in bf16
)
KEYS = ("score", "exact_match")  # the two measures the console shows, from the module's `eval_results` rows
LIGHTNING_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                     "lightning.fabric.utilities.seed")  # fmt: skip


class _DropKnownInfo(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or not str(record.msg).lstrip().startswith(QUIET_INFO)


_DROP = _DropKnownInfo()


def configure_console(level: str | None = None) -> None:
    """Quiet console unless `level` (default: the `LOGLEVEL` environment variable) names a logging level."""
    level = (level or os.environ.get("LOGLEVEL") or "").upper() or None
    if level is not None:
        number = logging.getLevelName(level)  # the number of a level name (getLevelNamesMapping is 3.11+)
        if not isinstance(number, int):
            raise ValueError(f"LOGLEVEL={level} is not a logging level (DEBUG, INFO, WARNING, ERROR)")
        logging.getLogger().setLevel(number)  # this project's own loggers (interleave_data.cache's progress bars)
        for name in ("lightning.pytorch", "lightning.fabric", "vllm"):
            logging.getLogger(name).setLevel(number)
        # read as each vLLM engine starts, by vLLM's name of the level (WARN is WARNING)
        os.environ["VLLM_LOGGING_LEVEL"] = logging.getLevelName(number)
        transformers.utils.logging.set_verbosity(number)
        datasets.utils.logging.set_verbosity(number)
        for name in LIGHTNING_LOGGERS:
            logging.getLogger(name).removeFilter(_DROP)
        warnings.filters[:] = [f for f in warnings.filters if not _is_quiet_filter(f)]
        transformers.utils.logging.enable_progress_bar()
        return
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name in LIGHTNING_LOGGERS:
        logging.getLogger(name).addFilter(_DROP)
    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" at every stage export


def _is_quiet_filter(entry: tuple) -> bool:
    action, message = entry[0], entry[1]
    return action == "ignore" and message is not None and message.pattern in QUIET_WARNINGS


class StepProgressBar(CompatRichProgressBar):
    """Lightning's rich progress bar without the epoch count a run bounded by steps does not have (`Epoch 0/-2`)."""

    @override
    def train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is None or self.trainer.max_epochs < 0:
            return f"{'Training':{len(self.validation_description)}}"
        return super().train_description(current_epoch)

    @property
    @override
    def total_train_batches(self) -> int | float:
        # an endless stream is one epoch, whose batch count starts at the run's start: the total is max_steps
        # (Lightning's remaining steps would read 80/20 after a resume at step 60)
        if math.isinf(self.trainer.num_training_batches) and self.trainer.max_steps > 0:
            return self.trainer.max_steps
        return super().total_train_batches

    @override
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the run folder is printed at the end
        if "stage" in items:
            items["stage"] = f"{float(items['stage']):.0f}w"  # words per fragment, logged as a float
        return items


class ConsoleSummary(L.Callback):
    """One line per held-out evaluation during `fit`; at the end of `fit`, `validate` and `test`, what happened.

    The summary gives, per evaluated length, the alignment score and exact match of the last evaluation (and, after
    `fit`, the change since the run's first; both are kept in the checkpoint, so a resumed run compares with the same
    one), what GRPO added (the change since the last evaluation before its first step, when a warm-start came
    first), the stage reached, the run folder and the TensorBoard command. Rank 0 prints.
    """

    def __init__(self) -> None:
        self.first: dict | None = None  # the run's first evaluation: {"split", "step", "lengths"}
        self.last: dict | None = None
        self.before_grpo: dict | None = None  # the last evaluation before GRPO's first step
        self._checkpoint_step: int | None = None
        self._ended: str | None = None  # the command whose end was reached: its summary is printed at teardown

    @override
    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        # validate / test do not restore the loops: the module's global_step would read 0
        self._checkpoint_step = checkpoint.get("global_step")

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self._take(trainer, pl_module):
            return
        if trainer.state.fn == TrainerFn.FITTING:
            first, self.first = self.first, self.first or self.last
            if trainer.global_step <= _grpo_start(trainer):  # no GRPO step yet
                self.before_grpo = self.last
            _say(evaluation_line(self.last, first, _stage(trainer)))
        else:
            self._ended = "validate"

    @override
    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._take(trainer, pl_module):
            self._ended = "test"

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._ended = "fit"

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # at teardown, after the progress bar's own (the CLI adds this callback after it), so the summary comes last;
        # a command that failed never reached its end hook and prints none
        if self._ended is not None:
            _say(self._summary(trainer, self._ended))
        self._ended = None

    @override
    def state_dict(self) -> dict:
        return {"first": self.first, "last": self.last, "before_grpo": self.before_grpo}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.first, self.last = state_dict.get("first"), state_dict.get("last")
        self.before_grpo = state_dict.get("before_grpo")

    def _take(self, trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
        results = getattr(pl_module, "eval_results", None)
        if not results or not results["lengths"]:
            return False
        fitting = trainer.state.fn == TrainerFn.FITTING
        step = results["step"] if fitting or self._checkpoint_step is None else self._checkpoint_step
        self.last = {"split": results["split"], "step": step, "lengths": results["lengths"]}
        return True

    def _summary(self, trainer: L.Trainer, command: str) -> str:
        run_dir = runs.run_dir(trainer)
        if command == "fit":
            done = f"step {trainer.global_step}" + (f"/{trainer.max_steps}" if trainer.max_steps > 0 else "")
        elif trainer.ckpt_path:
            done = f"checkpoint {trainer.ckpt_path} (step {self._checkpoint_step})"
        else:
            done = "no checkpoint (the weights as the config builds them)"
        lines = [f"{command} done: {done}, stage {_stage(trainer)}"]
        if self.last is not None:
            earlier = command == "fit" and self.first is not None and self.first["step"] < self.last["step"]
            first = self.first if earlier else None
            lines += score_table(self.last, first)
            grpo_start = _grpo_start(trainer)
            if command == "fit" and grpo_start and self.before_grpo and self.before_grpo["step"] < self.last["step"]:
                lines += grpo_lines(self.last, self.before_grpo, grpo_start, trainer.global_step)
        lines += [f"run folder: {run_dir}"]
        report = _report(trainer, run_dir)
        if report is not None:
            lines += [f"report: {report}"]
        if trainer.logger is not None:
            lines += [f"tensorboard --logdir {run_dir.parent}"]
        return "\n".join(lines)


def evaluation_line(results: dict, first: dict | None, stage: str) -> str:
    """`step 200  val 10w 0.994 (+0.210) exact 0.91 (+0.41)  stage 10 words`: one evaluation on one line."""
    cells = [f"{row['n_words']}w {_measures(row, before)}" for row, before in _with_first(results, first)]
    return f"step {results['step']}  {results['split']} " + ", ".join(cells) + f"  stage {stage}"


def score_table(results: dict, first: dict | None) -> list[str]:
    """The summary's rows: per length the score and exact match, and the change since `first` when given."""
    since = f", change since step {first['step']}" if first is not None else ""
    lines = [f"held-out {results['split']} at step {results['step']} (alignment score, exact match{since}):"]
    for row, before in _with_first(results, first):
        lines.append(f"  {row['n_words']:>4} words  {_measures(row, before)}  ({row['pairs']} pairs)")
    return lines


def grpo_lines(results: dict, before: dict, grpo_start: int, step: int) -> list[str]:
    """What GRPO added: per length, the score before GRPO's first step and now, after its steps."""
    lines = [f"GRPO added, steps {grpo_start}-{step} (held-out score at step {before['step']}, before GRPO -> now):"]
    for row, old in _with_first(results, before):
        if old is not None:
            change = row["score"] - old["score"]
            lines.append(f"  {row['n_words']:>4} words  {old['score']:.3f} -> {row['score']:.3f} ({change:+.3f})")
    return lines


def _with_first(results: dict, first: dict | None) -> list[tuple[dict, dict | None]]:
    before = {row["n_words"]: row for row in first["lengths"]} if first is not None else {}
    return [(row, before.get(row["n_words"])) for row in results["lengths"]]


def _measures(row: dict, before: dict | None) -> str:
    """`0.994 (+0.210) exact 0.910 (+0.410)`: the score and exact match, with their change since `before`."""
    score, exact = (f"{row[key]:.3f}" + (f" ({row[key] - before[key]:+.3f})" if before else "") for key in KEYS)
    return f"{score} exact {exact}"


def _grpo_start(trainer: L.Trainer) -> int:
    """The step GRPO starts at: the data's curriculum's (`Curriculum.grpo_start`), as a check may have moved it; 0
    on other data (GRPO from the first step)."""
    curriculum = getattr(trainer.datamodule, "curriculum", None)
    return 0 if curriculum is None else curriculum.grpo_start


def _stage(trainer: L.Trainer) -> str:
    """The stage the run has reached: the curriculum's, with how it ended when a CurriculumCallback acted on it."""
    curriculum = getattr(trainer.datamodule, "curriculum", None)
    if curriculum is None:
        return "-"
    if not any(isinstance(callback, CurriculumCallback) for callback in trainer.callbacks):
        return f"{curriculum.stage_words} words"
    state = curriculum.state
    what = " (stopped)" if state.stopped else " (learned, the last)" if state.done else ""
    return f"{curriculum.stage_words} words, {state.stage_index + 1} of {len(curriculum.stages)}{what}"


def _report(trainer: L.Trainer, run_dir: Path) -> Path | None:
    """The evaluation report the run wrote (EvaluationReport's `report.md`), if it wrote one."""
    for callback in trainer.callbacks:
        if isinstance(callback, EvaluationReport):
            path = Path(callback.dirpath or run_dir / "eval") / "report.md"
            return path if path.exists() else None
    return None


@rank_zero_only
def _say(text: str) -> None:
    print(text, flush=True)
