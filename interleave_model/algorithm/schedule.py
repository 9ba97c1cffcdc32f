"""Learning-rate schedule as a pure function of the step, so a resumed run needs no scheduler state."""

from __future__ import annotations

import math
from typing import get_args

from interleave_model.loss_settings import LrSchedule

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


def phase_learning_rate(
    phase: str,
    step: int,
    max_steps: int,
    learning_rate: float,
    sft_learning_rate: float,
    warmup_steps: int,
    sft_steps: int,
    lr_schedule: LrSchedule,
    grpo_start: int | None = None,
) -> float:
    """The learning rate at `step`: each phase has its own schedule.

    The SFT phase ("sft") decays by a cosine over its `sft_steps`; GRPO warms up again from where SFT ended
    (`grpo_start`, which is `sft_steps` unless the warm-start ended early) and follows `lr_schedule` to `max_steps`.
    The other arguments are `InterleaveGRPO`'s of the same names.
    """
    if phase == "sft":
        return sft_learning_rate * lr_factor(step, warmup_steps, sft_steps, "cosine")
    start = sft_steps if grpo_start is None else grpo_start
    step, total = step - start, max_steps - start
    return learning_rate * lr_factor(max(step, 0), warmup_steps, total, lr_schedule)
