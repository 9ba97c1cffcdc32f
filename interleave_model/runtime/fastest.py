"""The option that runs fastest on this machine, by measurement: which one is depends on the machine more than on
its flags (one Intel host decoded faster in float32, another in bfloat16), so the options that give the same result
are timed where they will run (`sampling.merged_copy: auto`, `optimization.micro_batch_size: auto`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable
from functools import partial

import torch


def timed(call: Callable[[], object], repeats: int) -> list[float]:
    """The wall seconds of `repeats` calls, the first one a warm-up left out when there are more."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return times[1:] or times


def agreed(seconds: dict[Hashable, float], device: torch.device | None = None) -> dict[Hashable, float]:
    """Each option's seconds summed over the ranks under torch.distributed (on `device`, the process group's), so
    that every rank picks the same option; as given on one process."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        summed = torch.tensor(list(seconds.values()), dtype=torch.float64, device=device)
        torch.distributed.all_reduce(summed)
        seconds = dict(zip(seconds, summed.tolist(), strict=True))
    return seconds


def fastest(
    options: dict[Hashable, Callable[[], object]], repeats: int = 2, device: torch.device | None = None
) -> tuple[Hashable, dict[Hashable, float]]:
    """The option whose call takes the least wall time here, and each option's seconds: the median of `repeats`
    calls, the first one a warm-up left out when there are more (`timed`), the same on every rank (`agreed`)."""
    seconds = agreed({option: statistics.median(timed(call, repeats)) for option, call in options.items()}, device)
    return min(seconds, key=seconds.get), seconds


def fastest_micro_batch(
    update: Callable[[int | None], object], num_generations: int, n_rows: int, device: torch.device | None = None
) -> tuple[int | None, str]:
    """`optimization.micro_batch_size: auto`: `update(size)` (the step's backward, `size` rows a forward, its gradients
    dropped) timed at one group a forward, twice that, ... and all `n_rows` at once (None); the fastest size and the
    line that says it, with every size's seconds."""
    G = num_generations
    sizes = [G * 2**k for k in range(n_rows.bit_length()) if G * 2**k < n_rows] + [None]
    chosen, seconds = fastest({size: partial(update, size) for size in sizes}, device=device)
    listed = ", ".join(f"{size or n_rows}: {s:.2f} s" for size, s in seconds.items())
    line = (f"model.optimization.micro_batch_size: auto takes {chosen or n_rows} rows a forward, the fastest here "
            f"(rows a forward: seconds of this step's update; {listed})")  # fmt: skip
    return chosen, line
