"""The learning rate: `lr_factor`, a pure function of the step, and `PhaseSchedule`, the optimizer's scheduler that
holds each phase's rate; a function of the step, so a resumed run needs no scheduler state."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, get_args

import torch
from torch.optim.lr_scheduler import LRScheduler
from typing_extensions import override

from interleave_model.settings.optimization import LrSchedule, Optimization

SCHEDULES = get_args(LrSchedule)


def lr_factor(
    step: int, warmup_steps: int, total_steps: int, schedule: LrSchedule = "cosine", min_ratio: float = 0.1
) -> float:
    """Multiplier of the base learning rate at `step`: linear warm-up, then cosine decay to `min_ratio` (or flat).

    Args:
        step: Optimizer steps taken so far (0-based).
        warmup_steps: Steps of linear warm-up from 1/(warmup_steps+1) to 1.
        total_steps: Step at which the cosine reaches `min_ratio`; <= 0 means unknown, and the schedule stays flat.
        schedule: "cosine" or "constant".
        min_ratio: Floor of the cosine, as a share of the base rate.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {SCHEDULES}, got {schedule!r}")
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min((step - warmup_steps) / (total_steps - warmup_steps), 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Phases(NamedTuple):
    """Where the phases lie (the data's curriculum, as each training batch carries it): `sft_steps` warm-start steps
    planned, GRPO from `grpo_start` (earlier where a held-out score ended the warm start)."""

    sft_steps: int
    grpo_start: int

    @classmethod
    def of(cls, batch: Mapping[str, Any]) -> Phases | None:
        """The phases a training batch carries; None for a batch without them (a loader other than the
        InterleaveDataModule's: GRPO from step 0)."""
        return cls(batch["sft_steps"], batch["grpo_start"]) if "grpo_start" in batch else None


class PhaseSchedule(LRScheduler):
    """The learning rate of each phase, as the optimizer's scheduler, built once from `model.optimization`.

    The warm start ("sft") decays by a cosine over its `sft_steps` from `sft_learning_rate`; GRPO warms up again from
    where the warm start ended (`grpo_start`) and follows `lr_schedule` to `max_steps` from `learning_rate`.

    A step's rate is a function of the step, its phase and where the phases lie, so the scheduler keeps no state: a
    resumed run, one from a checkpoint saved without a scheduler included, continues at the same rates, and a resume
    that sets another rate uses it. A step's phase and where the phases lie are its batch's, known as the batch
    arrives, and the curriculum may end the warm start at any check, so the rate is set just before the step (`at`),
    not after the step before.

    Args:
        optimizer: The optimizer whose rate this sets (every parameter group the same).
        settings: The rates, warm-up and schedule (`Optimization`).
        max_steps: The trainer's; <= 0 (unknown) keeps the GRPO phase flat after its warm-up.
        phases: Where the phases lie now, as the step's batch carries them; None (no curriculum) = GRPO from step 0.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        settings: Optimization,
        max_steps: int,
        phases: Callable[[], Phases | None],
    ) -> None:
        self.settings, self.max_steps, self.phases = settings, max_steps, phases
        self.phase = "grpo"
        super().__init__(optimizer)

    def rate(self, phase: str, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based: Lightning's `global_step` before it) in `phase`."""
        opt, phases = self.settings, self.phases()
        sft_steps, grpo_start = (0, 0) if phases is None else (phases.sft_steps, phases.grpo_start)
        if phase == "sft":
            return opt.sft_learning_rate * lr_factor(step, opt.warmup_steps, sft_steps, "cosine")
        step, total = step - grpo_start, self.max_steps - grpo_start
        return opt.learning_rate * lr_factor(max(step, 0), opt.warmup_steps, total, opt.lr_schedule)

    def at(self, phase: str, step: int) -> float:
        """Set the rate of optimizer step `step` in `phase`, before that step; the rate."""
        self.phase, self.last_epoch = phase, step
        lr = self.rate(phase, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._last_lr = [lr] * len(self.optimizer.param_groups)
        return lr

    @override
    def get_lr(self) -> list[float]:
        return [self.rate(self.phase, self.last_epoch)] * len(self.optimizer.param_groups)

    @override
    def state_dict(self) -> dict[str, Any]:
        """Nothing: the step is the trainer's, which its checkpoint restores, and the phases come with each batch."""
        return {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore (`state_dict`)."""
