"""Optimizer steps that keep time: a step whose loss or gradient norm is not finite is skipped and counted.

Skipping drops the gradients, so `optimizer.step()` still runs and counts (`max_steps` and the learning-rate schedule
stay on time) but moves nothing: AdamW skips parameters without a gradient, so neither the weights nor its state
change. The other steps are clipped where the gradients are the true ones: Lightning's `on_before_optimizer_step`
runs inside `optimizer.step()`, after a 16-mixed GradScaler has unscaled them (once); clipping before `step()` would
clip the scaled gradients (to `max_grad_norm / scale`).

The gradient norm is taken once a step, and both decisions read it: the skip, and the clip (`clip_grads_with_norm_`
with that norm is what `clip_grad_norm_` does after taking it). It is the norm of the gradients this rank holds, so
they must be whole on every rank (one device, DDP), not shards (FSDP).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from lightning.pytorch.strategies import FSDPStrategy, Strategy


def check_clipping(strategy: Strategy, max_norm: float) -> None:
    """Refuse clipping by norm under FSDP: the guard takes the norm of the gradients a rank holds, which FSDP shards
    (and Lightning's FSDP precision refuses clipping by norm too)."""
    if max_norm and isinstance(strategy, FSDPStrategy):
        raise ValueError("model.optimization.max_grad_norm: clipping needs whole gradients on each rank, and FSDP "
                         "shards them; set it to 0")  # fmt: skip


class StepGuard:
    """Skips and counts the steps that would move the weights by a non-finite amount.

    Attributes:
        skipped: Steps skipped so far (saved in checkpoints as `skipped_steps`).
        norm: The last step's gradient norm before clipping (None before any step, or when it had no gradient).
        clipped: Whether the last step was clipped (its norm above `max_norm`).
    """

    def __init__(self, skipped: int = 0) -> None:
        self.skipped = skipped
        self.norm: float | None = None
        self.clipped = False
        self._dropped = False  # this step's gradients were dropped for a non-finite loss

    def skip(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the gradients, so the coming `step()` is counted but moves nothing, and count the skip."""
        self.skipped += 1
        self._dropped = True
        optimizer.zero_grad(set_to_none=True)

    def before_step(
        self, optimizer: torch.optim.Optimizer, on_any_rank: Callable[[bool], bool], max_norm: float
    ) -> None:
        """Skip the step if its loss or gradient norm is not finite on any rank, else clip it to `max_norm` (0: no
        clipping).

        Every rank calls this once per step: `on_any_rank` (a collective) agrees on the skip, so every rank skips and
        counts the same steps. A step whose gradients `skip` dropped already is counted once.
        """
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else None
        local = self._dropped or (norm is not None and not torch.isfinite(norm).item())
        skip = on_any_rank(local)
        self.norm, self.clipped = (None if norm is None else norm.item()), False
        if skip and not self._dropped:
            self.skip(optimizer)
        elif not skip and max_norm and norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
            self.clipped = self.norm > max_norm
        self._dropped = False

    def step(self, optimizer: torch.optim.Optimizer, loss: float) -> dict[str, float]:
        """Step at the rate the schedule has set; a non-finite `loss` skips the step (`skip`), as `before_step` skips
        a non-finite gradient norm. Returns what the step logs: the steps skipped so far, and unless it skipped its
        rate, whether it was clipped and its gradient norm."""
        skipped, lr = self.skipped, optimizer.param_groups[0]["lr"]
        if not math.isfinite(loss):
            self.skip(optimizer)
        optimizer.step()  # Lightning's on_before_optimizer_step calls `before_step` inside
        logged = {"train/skipped_steps": float(self.skipped)}
        if self.skipped > skipped:
            return logged
        logged |= {"train/lr": lr, "train/grad_clipped": float(self.clipped)}
        return logged if self.norm is None else logged | {"train/grad_norm": self.norm}
