"""CurriculumCallback: hands each GRPO batch's counts to the DataModule's curriculum and carries out its decisions.

The decisions themselves are `interleave_data.curriculum.Curriculum`'s. This callback reads the `StepRecord` a GRPO
step returns (`outputs["record"]`; None on warm-start batches) and runs on every rank: counts are summed over ranks
before the curriculum sees them, so every rank decides the same thing at the same batch. A stop's advice comes as
data and becomes text here (`stop_message`): the settings to add to the run's fit command are the CLI's words, which
the data package does not know.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from interleave_data.curriculum import Curriculum
from interleave_data.curriculum_types import Decision, SmallerStep, StepCounts, StopAdvice
from interleave_model.algorithm.grpo import zero_std_groups
from interleave_model.evaluation.evaluator import metric_name
from interleave_model.model.export import export
from interleave_model.run.runs import run_dir
from interleave_model.runtime.machine import warn


class CurriculumCallback(L.Callback):
    """Carries out the curriculum's decisions: stage moves, temperature raises, stage exports and stops.

    The curriculum and its settings live in the DataModule (`data.curriculum`, `InterleaveDataModule.curriculum`),
    which checkpoints it. When a stage is learned the model is exported to `<run>/stages/<N>words/`, and the next
    stage starts with the first batch Lightning has not fetched yet (the batch after next).

    Args:
        export: Save the model at each stage end (and at the end of fit) under `<run>/stages/<N>words/`.
    """

    def __init__(self, export: bool = True) -> None:
        self.export = export
        self.curriculum: Curriculum | None = None
        self.run_dir: Path | None = None
        self._trained = False

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.curriculum = getattr(trainer.datamodule, "curriculum", None)
        if self.curriculum is None:
            raise ValueError("CurriculumCallback needs the InterleaveDataModule (fit with datamodule=...)")
        self.run_dir = run_dir(trainer)  # on every rank: under DDP, trainer.log_dir is a collective
        self.stages_dir = self.run_dir / "stages"  # each stage's end exported under it (`stage_folder`)

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        curriculum = self.curriculum
        record = outputs.get("record") if isinstance(outputs, Mapping) else None
        logged = {"curriculum/stage_words": float(curriculum.stage_words)}  # the batch's stage, before a decision
        counts = self._counts(record, trainer, pl_module) if record is not None and not curriculum.done else None
        if counts is not None:
            self._trained = True
            counts, pass_at_g, words = counts
            decision = curriculum.observe(counts)
            if decision.advice is not None:  # a stop: worded here, recorded by the curriculum
                exports = str(self.stages_dir) if self.export else None
                stopped = stop_message(decision.advice, exports)
                decision = replace(decision, message=curriculum.record_stop(stopped, counts))
            logged |= {
                "curriculum/batch_length": float(words),
                "curriculum/reward": counts.reward,
                "curriculum/reward_rolling": decision.rolling,
                "curriculum/success_rate": counts.success_rate,
                "curriculum/pass_at_g": pass_at_g,
                "curriculum/zero_std_share": counts.zero_std_share,
                "curriculum/stuck_share": counts.stuck_share,
                "curriculum/distinct_completions": counts.distinct,
            }
            self._apply(decision, trainer, pl_module)
        logged["curriculum/length"] = float(curriculum.length)  # after the decision: the length of the batches to come
        pl_module.log_dict(logged, batch_size=1)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self.curriculum is None:
            return
        value = trainer.callback_metrics.get(metric_name("val", "score", self.curriculum.stage_words))
        if value is not None:
            # the next batch is already fetched: a warm-start ended now ends from the batch after it
            run = trainer.datamodule.batches_run
            message = self.curriculum.observe_validation(float(value), run + 1, trainer.global_step)
            self._announce(message, trainer)
            decision = self.curriculum.observe_milestone(float(value), run - 1, trainer.global_step)
            if decision is not None:
                self._apply(decision, trainer, pl_module)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.export and self._trained and self.curriculum.state.stopped is None:
            self._export(trainer, pl_module, self.curriculum.stage_words)

    def _counts(self, record, trainer: L.Trainer, pl_module: L.LightningModule) -> tuple[StepCounts, float, int] | None:
        """This batch's rows at the current stage, summed over ranks, with the share of its groups that hold a success
        (pass@G) and the length counted; None when the batch is at another stage.

        Under the adaptive schedule the rows counted are those at the batch's own length (its longest: replayed rows
        are shorter), the one it was drawn at a batch before the last move; under fixed stages, the stage's rows.
        """
        curriculum = self.curriculum
        words = max(record.n_words) if curriculum.adaptive is not None else curriculum.stage_words
        local = group_counts(record, words, curriculum.success_level)
        total = trainer.strategy.reduce(
            torch.tensor(list(local.values()), dtype=torch.float64, device=pl_module.device), reduce_op="sum"
        )
        c = dict(zip(local, total.tolist(), strict=True))
        if not c["groups"]:
            return None
        run = trainer.datamodule.batches_run
        counts = StepCounts(
            reward=c["reward"] / c["rows"],
            zero_std_share=c["flat"] / c["groups"],
            stuck_share=c["stuck"] / c["groups"],
            distinct=c["distinct"] / c["groups"],
            temperature=pl_module.temperature,
            batch=run - 1,
            next_batch=run + 1,  # the next batch is already fetched at the old stage
            global_step=trainer.global_step,
            success_rate=c["succeeded"] / c["rows"],
        )
        return counts, c["passed"] / c["groups"], words

    def _apply(self, decision: Decision, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if decision.export_words is not None and self.export:
            self._export(trainer, pl_module, decision.export_words)
        if decision.temperature is not None:
            pl_module.set_temperature(decision.temperature)
        if decision.kind == "stop":
            warn(self.curriculum.state.stopped)  # one `warning:` line on stderr
        if decision.stop:
            trainer.should_stop = True
        self._announce(f"curriculum {decision.message}" if decision.message else "", trainer)

    @staticmethod
    def _announce(message: str, trainer: L.Trainer) -> None:
        """A transition's one line, on the console and in TensorBoard's text tab."""
        if not message:
            return
        rank_zero_info(message)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and trainer.is_global_zero:
                logger.experiment.add_text("curriculum/transitions", message, trainer.global_step)

    def _export(self, trainer: L.Trainer, pl_module: L.LightningModule, n_words: int) -> None:
        """The same folder as `cli.py export` writes: a HF model, or a peft adapter under LoRA."""
        if trainer.is_global_zero:
            source = {"stage_words": n_words, "global_step": trainer.global_step}
            export(pl_module, stage_folder(self.stages_dir, n_words), source=source)


def stage_folder(stages: str | Path, n_words: int) -> Path:
    """The folder a stage's end is exported to, under the run's `stages` folder: `<stages>/<N>words`."""
    return Path(stages) / f"{n_words}words"


def stop_message(advice: StopAdvice, exports: str | None) -> str:
    """A curriculum's stop in one line: why, then what to change, a smaller step between lengths first.

    Args:
        advice: The stop's why and what to change.
        exports: The folder stage ends are exported to (`stage_folder`); None = not exported.
    """
    smaller = [smaller_step_text(advice.smaller_step, exports)] if advice.smaller_step is not None else []
    return f"curriculum: stopping, {advice.why}. What to change: {'; or '.join([*smaller, *advice.others])}."


def smaller_step_text(step: SmallerStep, exports: str | None) -> str:
    """The settings to add to the run's fit command that go on with `step`'s stages, and from the last learned
    stage's weights (the exported folder, or a placeholder naming them) unless it is a rerun."""
    args = []
    if not step.rerun:
        learned = step.learned_words
        weights = stage_folder(exports, learned) if exports else f"<the {learned}-word stage's weights>"
        args += [f"--model.base.init_from {weights}", "--data.sft_steps 0"]
    args.append(f"--data.stages '{json.dumps(step.stages)}'")
    args += [f"--data.curriculum.{name} '{json.dumps(values)}'" for name, values in step.per_stage.items()]
    lists = " (the per-stage lists rewritten for these stages; one value applies to every stage)"
    how = "rerun" if step.rerun else "resume from the last learned stage"
    command = f"add `{' '.join(args)}` to this run's fit command{lists if step.per_stage else ''}"
    return f"{how} with a smaller step between lengths: {command}"


def group_counts(record, words: int, success: float) -> dict[str, float]:
    """Sums over the groups of a GRPO batch's `StepRecord` drawn at `words` words, when `words` is the batch's longest
    length (replayed rows are shorter): reward, rows, groups, zero-variance groups, stuck groups (zero variance and
    below `success`), distinct completions, groups of one answer repeated, successful rows (reward >= `success`) and
    groups holding one (pass@G)."""
    G = record.num_generations
    rewards = record.rewards.detach().float().cpu()  # [P*G]
    grouped = rewards.view(-1, G)  # [P, G]
    at_words = torch.tensor([n == words for n in record.n_words]) & (max(record.n_words) == words)  # [P]
    flat = zero_std_groups(rewards, G) & at_words  # [P]
    stuck = flat & (grouped.mean(dim=1) < success)  # [P]
    succeeded = (grouped >= success) & at_words[:, None]  # [P, G]
    distinct = [len(set(record.completions[g * G : (g + 1) * G])) for g in range(len(record.n_words))]
    return {
        "reward": grouped[at_words].sum().item(),
        "rows": float(at_words.sum() * G),
        "groups": float(at_words.sum()),
        "flat": float(flat.sum()),
        "stuck": float(stuck.sum()),
        "distinct": float(sum(d for d, keep in zip(distinct, at_words.tolist(), strict=True) if keep)),
        "identical": float(sum(d == 1 for d, keep in zip(distinct, at_words.tolist(), strict=True) if keep)),
        "succeeded": float(succeeded.sum()),
        "passed": float(succeeded.any(dim=1).sum()),
    }
