"""The option that runs fastest on this machine, by measurement: which one is depends on the machine more than on
its flags (one Intel host decoded faster in float32, another in bfloat16), so the options that give the same result
are timed where they will run (`sampling.merged_copy: auto`, `optimization.micro_batch_size: auto`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import torch


def fastest(
    options: dict[Hashable, Callable[[], object]], repeats: int = 2, device: torch.device | None = None
) -> tuple[Hashable, dict[Hashable, float]]:
    """The option whose call takes the least wall time here, and each option's seconds: the best of `repeats` calls,
    the first one a warm-up left out when there are more. Under torch.distributed the ranks' seconds are summed first
    (on `device`, the process group's), so every rank picks the same option."""
    seconds = {}
    for option, call in options.items():
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            call()
            times.append(time.perf_counter() - began)
        seconds[option] = min(times[1:] or times)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        summed = torch.tensor(list(seconds.values()), dtype=torch.float64, device=device)
        torch.distributed.all_reduce(summed)
        seconds = dict(zip(seconds, summed.tolist(), strict=True))
    return min(seconds, key=seconds.get), seconds
