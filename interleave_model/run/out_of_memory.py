"""Running out of GPU memory in a fit: the state before the step that ran out is saved as `last.ckpt`, and one line
says where, which setting to lower, and the command that resumes with it.

Without it, a CUDA out-of-memory error lost every step since the last periodic save (`every_n_train_steps`) and ended
in a traceback. `SaveOnOutOfMemory` (the CLI adds it to every run) sees the error in `on_exception`, before the
process exits, and saves what the last finished step left:

- the weights, the optimizer and `global_step` as they are: the step that ran out has not updated them yet, unless
  the error fell inside the optimizer's update itself (from `on_before_optimizer_step` until the step counts), where
  AdamW may have changed part of the weights and moments: then nothing is saved, and `--ckpt_path last` goes on from
  the last periodic save.
- the data stream set back to the batch that ran out, so that the resume runs it again: the warm-start's batches are
  counted in steps, and a batch skipped would start GRPO a step before its place. A batch that had already made an
  update (`model.loss.num_iterations` > 1) counts as run. The sampling and dropout RNGs stay where the failed step
  left them: the resumed run is a consistent one, not the bitwise continuation a stopped one is (tests/test_resume.py).

Under DDP only rank 0 writes, and with no collective: the other ranks may be waiting in one (the gradients'
all-reduce) for the rank that ran out, the only one that sees the error. A rank other than 0 saves nothing, nor does
a strategy whose save needs every rank (FSDP).

Before the fit starts (`on_fit_start`) it does nothing: a resumed run's state is not restored yet, and its
`last.ckpt` must stay as it is; no step ran, so torch's own message says what there is to say.

The line is added to the error as a note; `cli.run` prints it (or torch's message) as one `error:` line, without a
traceback, and exits 1: the run failed, where exit status 2 says a command was refused before it ran.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import NamedTuple

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from interleave_model.run.interrupt import save_last
from interleave_model.settings.groups import as_group
from interleave_model.settings.sampling import VllmSettings

# the strategies whose rank 0 holds the whole state and writes it alone (FSDP gathers it from every rank)
WHOLE_ON_RANK_ZERO = (SingleDeviceStrategy, DDPStrategy)
GENERATION = "interleave_model.generation"  # a frame of this package: it ran out while sampling
# where in a fit it ran out (`ran_out_in`)
VALIDATING, SAMPLING, PASSES = "in a validation", "while sampling", "in a forward or backward pass"


class MemorySettings(NamedTuple):
    """What a fit's memory grows with, as the run has it."""

    prompts: int  # data.batch_size
    generations: int  # model.sampling.num_generations
    rows_a_forward: int  # model.optimization.micro_batch_size as it runs: all the step's rows when unset
    checkpointing: bool  # model.base.gradient_checkpointing
    engine_awake: bool  # the vLLM engine samples and keeps its memory through the update (no sleep mode)
    eval_prompts: int  # data.eval_batch_size
    eval_samples: int  # model.evaluation.num_samples


class Knob(NamedTuple):
    """A setting that lowers a fit's memory: its flag, the value to resume with, and what that trades."""

    flag: str
    value: str
    trade: str


class SaveOnOutOfMemory(L.Callback):
    """On a CUDA out-of-memory error in a fit, save the state before the step that ran out as `last.ckpt`, and note on
    the error, in one line: the step, where the state went, the setting to lower and the command that resumes.

    Args:
        resume: The command that resumes this run (`python cli.py fit ... --ckpt_path last`), to which the line adds
            the lowered setting; None names it as this command with `--ckpt_path last`.
    """

    def __init__(self, resume: str | None = None) -> None:
        self.resume = resume
        self._finished: tuple[int, int] | None = None  # global_step and batches run as the last batch ended
        self._updating: int | None = None  # the step whose optimizer update began last

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._finished = self._updating = None

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._note_finished(trainer)  # a resumed run's, its checkpoint restored by now

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self._note_finished(trainer)

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        # global_step moves once the update is done: until then the weights may be half updated
        self._updating = trainer.global_step

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING and self._finished is not None  # since on_fit_start
        if not isinstance(exception, torch.OutOfMemoryError) or not fitting:
            return
        mid_update = self._updating == trainer.global_step
        saved, unsaved = None, why_not_saved(mid_update, trainer.strategy, trainer.is_global_zero)
        if unsaved is None:
            self._rewind_data(trainer)
            saved = save_last(trainer, alone=True)
            unsaved = "the run has no ModelCheckpoint" if saved is None else None
        phase = ran_out_in(exception)
        rank = f" on rank {trainer.global_rank}" if trainer.world_size > 1 else ""
        where = f"fit ran out of GPU memory{rank}{f' {phase}' if phase else ''} at step {trainer.global_step}"
        knobs = memory_knobs(phase, memory_settings(pl_module, trainer.datamodule))
        exception.add_note(out_of_memory_line(where, saved, unsaved, knobs, self.resume))

    def _note_finished(self, trainer: L.Trainer) -> None:
        self._finished = trainer.global_step, trainer.datamodule.batches_run

    def _rewind_data(self, trainer: L.Trainer) -> None:
        """Set the data stream back to the batch that ran out, unless that batch already made an update (see the
        module's docstring), through the datamodule's own state, as a resume restores it."""
        step, batches_run = self._finished
        if trainer.global_step == step:
            datamodule = trainer.datamodule
            datamodule.load_state_dict(datamodule.state_dict() | {"batches_run": batches_run})


def why_not_saved(mid_update: bool, strategy: Strategy, rank_zero: bool) -> str | None:
    """Why the state cannot be saved where the error came, or None when it can.

    Args:
        mid_update: The error came inside the optimizer's update.
        strategy: The trainer's strategy.
        rank_zero: The error came on rank 0.
    """
    if mid_update:
        return "it ran out inside the optimizer's update, which may have changed part of the weights"
    if type(strategy) not in WHOLE_ON_RANK_ZERO:
        return f"{type(strategy).__name__} saves only with every rank"
    if not rank_zero:
        return "only rank 0 saves, and it may be waiting on this rank"
    return None


def ran_out_in(exception: BaseException) -> str | None:
    """Where in a fit the error was raised: `VALIDATING`, `SAMPLING` (a training step's rollout), `PASSES` (the rest of
    a training step: the update's forwards and backwards, the log-probs the rollout is scored with), or None."""
    frames = [frame for frame, _ in traceback.walk_tb(exception.__traceback__)]
    names = {frame.f_code.co_name for frame in frames}
    if "validation_step" in names:
        return VALIDATING
    if "training_step" not in names:
        return None
    return SAMPLING if any(frame.f_globals.get("__name__", "").startswith(GENERATION) for frame in frames) else PASSES


def memory_settings(pl_module: L.LightningModule, datamodule: L.LightningDataModule) -> MemorySettings:
    """The run's `MemorySettings`, read from the CLI's `InterleaveGRPO` and `InterleaveDataModule`."""
    prompts, generations = datamodule.batch_size, pl_module.sampling.num_generations
    rows = prompts * generations
    vllm = as_group(VllmSettings, pl_module.hparams.get("vllm"))
    awake = pl_module.hparams.get("rollout_engine") == "vllm" and not vllm.enable_sleep_mode
    return MemorySettings(
        prompts, generations, min(pl_module.micro_batch_size or rows, rows), pl_module.base.gradient_checkpointing,
        awake, datamodule.eval_batch_size, pl_module.evaluation.num_samples,
    )  # fmt: skip


def memory_knobs(phase: str | None, settings: MemorySettings) -> list[Knob]:
    """The settings that lower the memory of the part that ran out, those that keep the run's results first.

    A validation holds its batch's answers: fewer prompts a batch, fewer samples each. Sampling holds every row's KV
    cache: fewer prompts or completions a step. A forward or backward pass holds its rows' activations: fewer rows a
    forward (the same gradient), gradient checkpointing, vLLM's sleep during the update, then fewer rows a step
    (docs/SCALING.md, "Knobs"). Elsewhere, a training step's.
    """
    s, knobs = settings, []
    if phase == VALIDATING:
        if s.eval_prompts > 1:
            knobs.append(Knob("--data.eval_batch_size", str(s.eval_prompts // 2), "fewer prompts a validation batch"))
        if s.eval_samples > 0:
            knobs.append(Knob("--model.evaluation.num_samples", str(s.eval_samples // 2), "fewer sampled answers"))
        return knobs
    if phase != SAMPLING:
        if s.rows_a_forward > 1:
            knobs.append(Knob("--model.optimization.micro_batch_size", str(s.rows_a_forward // 2),
                              "the same gradient in smaller forwards"))  # fmt: skip
        if not s.checkpointing:
            knobs.append(Knob("--model.base.gradient_checkpointing", "true", "about 30% more update time"))
        if s.engine_awake:
            knobs.append(Knob("--model.vllm.enable_sleep_mode", "true", "the engine's memory freed for the update"))
    if s.prompts > 1:
        knobs.append(Knob("--data.batch_size", str(s.prompts // 2), "fewer prompts a step"))
    if s.generations >= 4:  # a group needs two
        knobs.append(Knob("--model.sampling.num_generations", str(s.generations // 2), "fewer completions a prompt"))
    return knobs


def out_of_memory_line(
    where: str, saved: Path | None, unsaved: str | None, knobs: list[Knob], resume: str | None
) -> str:
    """The one line: where it ran out, what was saved (or why nothing), and the resume with the first knob lowered.

    Args:
        where: "fit ran out of GPU memory ... at step N".
        saved: The checkpoint written, or None.
        unsaved: Why nothing was written, when nothing was.
        knobs: The settings to lower, the one to resume with first.
        resume: The command that resumes the run; None: this command with `--ckpt_path last`.
    """
    if saved is not None:
        state = f"saved the state before it as {saved}"
    else:
        state = f"nothing saved ({unsaved}), --ckpt_path last goes on from the last periodic save"
    command = resume or "this command with --ckpt_path last"
    if not knobs:
        return f"{where}: {state}; resume with less memory a step: {command}"
    first, *others = knobs
    line = f"{where}: {state}; resume with {first.trade}: {command} {first.flag} {first.value}"
    if others:
        line += " (or " + "; ".join(f"{knob.flag} {knob.value}: {knob.trade}" for knob in others) + ")"
    return line


def out_of_memory_message(error: torch.OutOfMemoryError) -> str:
    """What to print for an out-of-memory error: the line `SaveOnOutOfMemory` noted on it in a fit, else torch's own
    message, on one line."""
    notes = getattr(error, "__notes__", None)
    return notes[-1] if notes else " ".join(str(error).split())
