"""Statistics over every DDP rank's batch, as one process holding them all would compute them.

Each function takes `sum_over_ranks`, the sum of a tensor over all ranks (the tensor itself on one process): the
module passes its strategy's reduction, a test can pass any function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from interleave_model.algorithm import grpo
from interleave_model.settings import AdvantageEstimator


def batch_scaled_advantages(
    rewards: Tensor,
    num_generations: int,
    estimator: AdvantageEstimator,
    sum_over_ranks: Callable[[Tensor], Tensor],
) -> Tensor:
    """Advantages [P*G] scaled by the reward std of every rank's batch (`scale_rewards: batch`)."""
    count = sum_over_ranks(rewards.new_tensor(float(rewards.numel())))
    mean = sum_over_ranks(rewards.sum()) / count
    squares = sum_over_ranks((rewards - mean).pow(2).sum())
    std = (squares / (count - 1).clamp(min=1.0)).sqrt()  # unbiased, as torch.std
    return grpo.group_advantages(rewards, num_generations, "batch", estimator, batch_std=std)


def mean_over_ranks(
    values: dict[str, float], sum_over_ranks: Callable[[Tensor], Tensor], device: torch.device | None = None
) -> dict[str, float]:
    """Each value's mean over the ranks, in one reduction; every rank must pass the same names.

    `device` is where the reduction runs (the rank's GPU under NCCL).
    """
    names = sorted(values)
    totals = sum_over_ranks(torch.tensor([values[name] for name in names] + [1.0], dtype=torch.float64, device=device))
    *totals, ranks = totals.tolist()
    return {name: total / ranks for name, total in zip(names, totals, strict=True)}
