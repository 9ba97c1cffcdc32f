"""Callbacks: CurriculumCallback moves the DataModule through its stages and watches for collapse; SampleDump writes
the best and the worst completion of a step.

Both read the `StepRecord` a GRPO step returns (`outputs["record"]`; None on warm-start batches) and run on every
rank: counts are summed over ranks before any decision, so every rank decides the same thing at the same batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from interleave_data.curriculum import Stage
from interleave_data.datamodule import batches_run
from interleave_model.alignment import align
from interleave_model.export import export
from interleave_model.runs import run_dir
from interleave_model.samples import sample_markdown

COLLAPSE_RESPONSES = ("raise_temperature", "step_back", "stop")


@dataclass
class CurriculumState:
    """Everything the curriculum decides from; saved in the checkpoint, so a resumed run decides the same.

    Attributes:
        stage_index: The stage being trained; batches drawn at another stage (in flight at a move) are not counted.
        steps: GRPO batches counted at this stage.
        recent: Mean reward at this stage of the last `window` batches.
        above: Consecutive batches whose rolling mean reward was at or above the stage's threshold.
        collapsed: Consecutive batches whose share of stuck groups reached `collapse_share`.
        val_score: The last validation score at this stage's length (None until one is seen at this stage).
        temperature: The rollout temperature once a collapse response raised it, else None.
        responses: Collapse responses so far, per stage length.
        done: The last stage passed its threshold.
        stopped: Why the curriculum stopped training, if it did.
        history: One entry per transition (stage moves, temperature raises, the end).
    """

    stage_index: int = 0
    steps: int = 0
    recent: list[float] = field(default_factory=list)
    above: int = 0
    collapsed: int = 0
    val_score: float | None = None
    temperature: float | None = None
    responses: dict[int, int] = field(default_factory=dict)
    done: bool = False
    stopped: str | None = None
    history: list[dict] = field(default_factory=list)


class CurriculumCallback(L.Callback):
    """Advances the DataModule's stage when the current one is learned; responds when training collapses.

    A stage is learned when, after `min_steps` GRPO batches at it, the rolling mean reward of its rows (over `window`
    batches) has stayed at or above `threshold` for `patience` batches, and, if `val_threshold` is set, the last
    validation score at its length reaches it. The model is then exported to `<run>/stages/<N>words/`, and the
    next stage starts with the first batch Lightning has not fetched yet (the batch after next), a point recorded
    in the checkpoint so a resumed run switches at the same batch.

    A group is stuck when its G rewards are all equal and below the stage's threshold (a group that is all
    correct is solved, not collapsed). When stuck groups make up `collapse_share` of a batch's groups for
    `collapse_patience` batches in a row, the callback responds with `on_collapse`: "raise_temperature" (by
    `temperature_step`, up to `max_temperature`), "step_back" (to the previous stage) or "stop" (end training with
    a message). After `max_collapse_responses` responses at one stage length, or when no response is left (at the
    temperature cap, or at the first stage), it stops.

    Args:
        threshold: Reward a stage needs; one value for all stages or one per stage.
        patience: Consecutive batches above the threshold; one value or one per stage.
        min_steps: GRPO batches at a stage before it may end; one value or one per stage.
        window: Batches in the rolling mean reward.
        val_threshold: Validation score at the stage's length also required to move on; None = not required.
        collapse_share: Share of stuck groups that makes a batch count as collapsed.
        collapse_patience: Consecutive collapsed batches before a response.
        on_collapse: "raise_temperature", "step_back" or "stop".
        temperature_step: Added to the rollout temperature by each "raise_temperature" response.
        max_temperature: Highest temperature "raise_temperature" goes to.
        max_collapse_responses: Responses at one stage length before the run stops.
        export: Save the model at each stage end (and at the end of fit) under `<run>/stages/<N>words/`.
        stop_when_done: Stop training when the last stage is learned.
    """

    def __init__(
        self,
        threshold: float | list[float] = 0.9,
        patience: int | list[int] = 20,
        min_steps: int | list[int] = 50,
        window: int = 10,
        val_threshold: float | None = None,
        collapse_share: float = 0.8,
        collapse_patience: int = 10,
        on_collapse: str = "raise_temperature",
        temperature_step: float = 0.25,
        max_temperature: float = 1.5,
        max_collapse_responses: int = 3,
        export: bool = True,
        stop_when_done: bool = False,
    ) -> None:
        if on_collapse not in COLLAPSE_RESPONSES:
            raise ValueError(f"on_collapse must be one of {COLLAPSE_RESPONSES}, got {on_collapse!r}")
        if window < 1 or collapse_patience < 1 or max_collapse_responses < 1:
            raise ValueError("window, collapse_patience and max_collapse_responses must be >= 1")
        if not 0.0 < collapse_share <= 1.0:
            raise ValueError(f"collapse_share must be in (0, 1], got {collapse_share}")
        self.threshold, self.patience, self.min_steps = threshold, patience, min_steps
        self.window = window
        self.val_threshold = val_threshold
        self.collapse_share = collapse_share
        self.collapse_patience = collapse_patience
        self.on_collapse = on_collapse
        self.temperature_step = temperature_step
        self.max_temperature = max_temperature
        self.max_collapse_responses = max_collapse_responses
        self.export = export
        self.stop_when_done = stop_when_done
        self.state = CurriculumState()
        self.stages: list[Stage] = []
        self.run_dir: Path | None = None
        self._restored = False
        self._trained = False

    # ---------------------------------------------------------------- Lightning hooks

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        datamodule = trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "set_stage"):
            raise ValueError("CurriculumCallback needs the InterleaveDataModule (fit with datamodule=...)")
        lengths = list(datamodule.stages)
        self.stages = [
            Stage(n, *(_per_stage(v, name, lengths)[i] for v, name in self._stage_settings()))
            for i, n in enumerate(lengths)
        ]
        self.run_dir = run_dir(trainer)
        if not self._restored:
            self.state.stage_index = datamodule.stage_index

    def _stage_settings(self):
        return ((self.threshold, "threshold"), (self.patience, "patience"), (self.min_steps, "min_steps"))

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.state.temperature is not None:
            pl_module.sampling.temperature = self.state.temperature

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = outputs.get("record") if isinstance(outputs, Mapping) else None
        counts = self._counts(record, trainer, pl_module) if record is not None and not self.state.done else None
        stage = self.stages[self.state.stage_index]
        logged = {"curriculum/stage_words": float(stage.n_words)}
        if counts is not None:
            logged |= self._update(stage, counts)
            self._decide(trainer, pl_module, stage)
        pl_module.log_dict(logged, batch_size=1)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self.stages:
            return
        value = trainer.callback_metrics.get(f"val/alignment_{self.stages[self.state.stage_index].n_words}w")
        if value is not None:
            self.state.val_score = float(value)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.export and self._trained and self.state.stopped is None:
            self._export(trainer, pl_module, self.stages[self.state.stage_index].n_words)

    @override
    def state_dict(self) -> dict:
        return asdict(self.state)

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.state = CurriculumState(**state_dict)
        self._restored = True

    # ---------------------------------------------------------------- the decisions

    def _counts(self, record, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float] | None:
        """Sums over ranks of this batch's rows at the current stage; None when the batch is at another stage."""
        words = self.stages[self.state.stage_index].n_words
        G = record.num_generations
        rewards = record.rewards.detach().float().cpu().view(-1, G)  # [P, G]
        at_stage = torch.tensor([n == words for n in record.n_words]) & (max(record.n_words) == words)  # [P]
        means = rewards.mean(dim=1)  # [P]
        flat = (rewards == rewards[:, :1]).all(dim=1) & at_stage  # [P]
        stuck = flat & (means < self.stages[self.state.stage_index].threshold)  # [P]
        distinct = [len(set(record.completions[g * G : (g + 1) * G])) for g in range(len(record.n_words))]
        local = [
            rewards[at_stage].sum().item(),
            float(at_stage.sum() * G),
            float(at_stage.sum()),
            float(flat.sum()),
            float(stuck.sum()),
            float(sum(d for d, keep in zip(distinct, at_stage.tolist(), strict=True) if keep)),
        ]
        total = trainer.strategy.reduce(
            torch.tensor(local, dtype=torch.float64, device=pl_module.device), reduce_op="sum"
        )
        reward_sum, rows, groups, n_flat, n_stuck, n_distinct = total.tolist()
        if not groups:
            return None
        return {
            "reward": reward_sum / rows,
            "zero_std_share": n_flat / groups,
            "stuck_share": n_stuck / groups,
            "distinct": n_distinct / groups,
        }

    def _update(self, stage: Stage, counts: dict[str, float]) -> dict[str, float]:
        state = self.state
        self._trained = True
        state.steps += 1
        state.recent = (state.recent + [counts["reward"]])[-self.window :]
        rolling = sum(state.recent) / len(state.recent)
        state.above = state.above + 1 if rolling >= stage.threshold else 0
        state.collapsed = state.collapsed + 1 if counts["stuck_share"] >= self.collapse_share else 0
        return {
            "curriculum/reward": counts["reward"],
            "curriculum/reward_rolling": rolling,
            "curriculum/zero_std_share": counts["zero_std_share"],
            "curriculum/stuck_share": counts["stuck_share"],
            "curriculum/distinct_completions": counts["distinct"],
        }

    def _decide(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: Stage) -> None:
        state = self.state
        if state.collapsed >= self.collapse_patience:
            self._respond_to_collapse(trainer, pl_module, stage)
            return
        learned = state.steps >= stage.min_steps and state.above >= stage.patience
        if self.val_threshold is not None:
            learned = learned and state.val_score is not None and state.val_score >= self.val_threshold
        if not learned:
            return
        rolling = sum(state.recent) / len(state.recent)
        if self.export:
            self._export(trainer, pl_module, stage.n_words)
        if state.stage_index + 1 == len(self.stages):
            state.done = True
            self._note(trainer, "done", stage.n_words, stage.n_words, f"last stage learned (reward {rolling:.3f})")
            if self.stop_when_done:
                trainer.should_stop = True
            return
        self._move(trainer, state.stage_index + 1, "advance", f"reward {rolling:.3f} >= {stage.threshold}")

    def _respond_to_collapse(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: Stage) -> None:
        state = self.state
        n = stage.n_words
        state.responses[n] = state.responses.get(n, 0) + 1
        state.collapsed = 0
        reward = sum(state.recent) / len(state.recent)
        what = (
            f"collapse at {n} words: stuck groups (all G rewards equal, below {stage.threshold}) made up "
            f">= {self.collapse_share:.0%} of the batch for {self.collapse_patience} batches (reward {reward:.3f})"
        )
        temperature = pl_module.sampling.temperature
        if state.responses[n] > self.max_collapse_responses:
            self._stop(trainer, what, f"{self.max_collapse_responses} responses at this length did not help")
        elif self.on_collapse == "stop":
            self._stop(trainer, what, "on_collapse is 'stop'")
        elif self.on_collapse == "raise_temperature":
            if temperature >= self.max_temperature:
                self._stop(trainer, what, f"the temperature is already at max_temperature={self.max_temperature}")
                return
            state.temperature = min(temperature + self.temperature_step, self.max_temperature)
            pl_module.sampling.temperature = state.temperature
            self._note(trainer, "raise_temperature", n, n, f"{what}; temperature {temperature} -> {state.temperature}")
        elif state.stage_index == 0:
            self._stop(trainer, what, "there is no earlier stage to step back to")
        else:
            self._move(trainer, state.stage_index - 1, "step_back", what)

    def _move(self, trainer: L.Trainer, index: int, kind: str, why: str) -> None:
        """Move the curriculum and the DataModule to stage `index` from the first batch not fetched yet."""
        state = self.state
        old, new = self.stages[state.stage_index].n_words, self.stages[index].n_words
        from_batch = batches_run(trainer) + 1  # the next batch is already fetched at the old stage
        trainer.datamodule.set_stage(index, from_batch=from_batch)
        self._note(trainer, kind, old, new, why, from_batch=from_batch)
        self.state = CurriculumState(
            stage_index=index,
            temperature=state.temperature,
            responses=state.responses,
            history=state.history,
        )

    def _stop(self, trainer: L.Trainer, what: str, why: str) -> None:
        words = self.stages[self.state.stage_index].n_words
        learned = [h["from_words"] for h in self.state.history if h["kind"] == "advance"]
        start = f"--model.init_from {self.run_dir}/stages/{learned[-1]}words" if learned and self.export else "it"
        message = (
            f"curriculum: stopping, {what}, and {why}. Continue from the last learned stage ({start}) with a "
            "smaller step between stage lengths, a supervised warm-start at this length, or a higher temperature."
        )
        self.state.stopped = message
        self._note(trainer, "stop", words, words, message)
        rank_zero_warn(message)
        trainer.should_stop = True

    def _note(self, trainer: L.Trainer, kind: str, old: int, new: int, why: str, **extra) -> None:
        entry = {"kind": kind, "from_words": old, "to_words": new, "batch": batches_run(trainer) - 1}
        entry |= {"global_step": trainer.global_step, "why": why} | extra
        self.state.history.append(entry)
        text = f"{kind}: {old} -> {new} words at step {trainer.global_step} ({why})"
        rank_zero_info(f"curriculum {text}")
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and trainer.is_global_zero:
                logger.experiment.add_text("curriculum/transitions", text, trainer.global_step)

    def _export(self, trainer: L.Trainer, pl_module: L.LightningModule, n_words: int) -> None:
        """The same folder as `cli.py export` writes: a HF model, or a peft adapter under LoRA."""
        if trainer.is_global_zero:
            source = {"stage_words": n_words, "global_step": trainer.global_step}
            export(pl_module, self.run_dir / "stages" / f"{n_words}words", source=source)


class SampleDump(L.Callback):
    """Every `every_n_steps` GRPO batches, the best and the worst completion of the batch over all ranks.

    Written by rank 0 to `<run>/<filename>` (appended, so a resumed run adds to it) and to TensorBoard text:
    prompt, target, completion, reward and the first-error position (the target word where the completion first
    departs from it); in TensorBoard each text is whole and the departing word is marked (`samples.sample_markdown`).

    Args:
        every_n_steps: Batches between dumps.
        filename: Log file name inside the run folder.
    """

    def __init__(self, every_n_steps: int = 50, filename: str = "samples.log") -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.filename = filename
        self.path: Path | None = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.path = run_dir(trainer) / self.filename

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = outputs.get("record") if isinstance(outputs, Mapping) else None
        if record is None or batches_run(trainer) % self.every_n_steps:
            return
        rewards = record.rewards.detach().float().cpu().tolist()  # [P*G]
        G = record.num_generations
        ends = [max(range(len(rewards)), key=rewards.__getitem__), min(range(len(rewards)), key=rewards.__getitem__)]
        local = [
            (rewards[i], record.prompts[i // G], record.targets[i // G], record.completions[i], record.n_words[i // G])
            for i in ends
        ]
        candidates = _gather_objects(local, trainer)
        if trainer.is_global_zero:
            best = max(candidates, key=lambda c: c[0])
            worst = min(candidates, key=lambda c: c[0])
            self._write(trainer, [("best", *best), ("worst", *worst)])

    def _write(self, trainer: L.Trainer, samples: list[tuple]) -> None:
        step, lines, markdown = trainer.global_step, [], []
        for name, reward, prompt, target, completion, n_words in samples:
            first_error, n_target = align(completion, target).first_error, len(target.split())
            head = f"{name}: reward {reward:.3f}, first error at word {first_error}/{n_target}, {n_words} words"
            lines += [f"=== step {step} {head}", f"prompt: {prompt}", f"target: {target}", f"completion: {completion}"]
            markdown.append(sample_markdown(f"step {step} {head}", prompt, target, completion))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("\n".join(line.replace("\n", "\\n") for line in lines) + "\n\n")
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("samples", "\n\n---\n\n".join(markdown), step)


def _per_stage(value, name: str, lengths: list[int]) -> list:
    """One value per stage from a single value or a list of one value per stage."""
    if not isinstance(value, list | tuple):
        return [value] * len(lengths)
    if len(value) != len(lengths):
        raise ValueError(f"CurriculumCallback.{name} has {len(value)} values for {len(lengths)} stages {lengths}")
    return list(value)


def _gather_objects(obj, trainer: L.Trainer) -> list:
    """Every rank's list `obj`, concatenated in rank order (just `obj` on one process)."""
    if trainer.world_size == 1 or not torch.distributed.is_initialized():
        return list(obj)
    gathered = [None] * trainer.world_size
    torch.distributed.all_gather_object(gathered, obj)
    return [item for part in gathered for item in part]
