"""The optimizer and its schedule (`model.optimization`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from interleave_model.settings import SettingsError

# The string choices, as types: a config naming another value is refused when it is parsed, before any step runs.
LrSchedule = Literal["cosine", "constant"]


@dataclass
class Optimization:
    """The optimizer and its schedule (`model.optimization`).

    Args:
        learning_rate: Peak learning rate of the GRPO phase.
        sft_learning_rate: Peak learning rate of the supervised warm-start phase.
        weight_decay: AdamW weight decay.
        warmup_steps: Linear warm-up steps, at the start of each phase.
        lr_schedule: Schedule of the GRPO phase after warm-up: "constant" (what a curriculum needs: it has no known
            length for a decay to end at) or "cosine" (to 10% at trainer.max_steps; the 10-word 3B config's).
            The SFT phase always decays by a cosine over the data's `data.sft_steps` (the curriculum schedules the
            phases: `InterleaveGRPO.phases`).
        max_grad_norm: Gradient clipping norm; 0 disables.
        micro_batch_size: Rows per forward in the update and in the supervised steps (the warm start, guidance's
            term): gradient accumulation inside a step, the same gradient; None = all rows. "auto": at the first GRPO
            step, the update's forward and backward are timed on that step's rows at one group a forward
            (`sampling.num_generations` rows), twice that, and so on, and all rows at once; the fastest is kept for
            the run and said in one line (`InterleaveGRPO.micro_batch_size`). Steps before it take one group.
    """

    learning_rate: float = 1e-5
    sft_learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_schedule: LrSchedule = "constant"
    max_grad_norm: float = 1.0
    micro_batch_size: int | Literal["auto"] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.micro_batch_size, int) and self.micro_batch_size < 1:
            raise SettingsError(
                f"model.optimization.micro_batch_size must be null, auto or >= 1, got {self.micro_batch_size}"
            )
