"""Statistics over every DDP rank's batch, as one process holding them all would compute them.

`mean_over_ranks` takes `sum_over_ranks`, the sum of a tensor over all ranks (the tensor itself on one process): the
module passes its strategy's reduction, a test can pass any function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


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
