"""Optimizer steps that keep time: a step whose loss or gradient norm is not finite is skipped and counted.

Skipping drops the gradients, so `optimizer.step()` still runs and counts (`max_steps` and the learning-rate schedule
stay on time) but moves nothing: AdamW skips parameters without a gradient, so neither the weights nor its state
change. The other steps are clipped where the gradients are the true ones: Lightning's `on_before_optimizer_step`
runs inside `optimizer.step()`, after a 16-mixed GradScaler has unscaled them (once); clipping before `step()` would
clip the scaled gradients (to `max_grad_norm / scale`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class StepGuard:
    """Skips and counts the steps that would move the weights by a non-finite amount.

    Attributes:
        skipped: Steps skipped so far (saved in checkpoints as `skipped_steps`).
    """

    def __init__(self, skipped: int = 0) -> None:
        self.skipped = skipped

    def skip(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the gradients, so the coming `step()` is counted but moves nothing, and count the skip."""
        self.skipped += 1
        optimizer.zero_grad(set_to_none=True)

    def before_step(
        self,
        optimizer: torch.optim.Optimizer,
        on_any_rank: Callable[[bool], bool],
        clip: Callable[[torch.optim.Optimizer], None] | None,
    ) -> bool:
        """Skip the step if its gradient norm is not finite on any rank, else `clip` it; True when it skipped.

        Every rank calls this once per step: `on_any_rank` (a collective) agrees on the skip. A step whose gradients
        were already dropped (a non-finite loss, skipped and counted by `skip`) is left alone.
        """
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        local = bool(grads) and not torch.isfinite(torch.nn.utils.get_total_norm(grads)).item()
        skip = on_any_rank(local)
        if not grads:
            return False
        if skip:
            self.skip(optimizer)
        elif clip is not None:
            clip(optimizer)
        return skip
