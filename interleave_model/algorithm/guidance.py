"""Reference guidance: the known target teaches beside GRPO, CHORD-mu (Zhang et al. 2025, "On-Policy RL Meets
Off-Policy Experts: Harmonizing Supervised Fine-Tuning and Reinforcement Learning via Dynamic Weighting",
arXiv 2508.11408).

Every prompt of this task has its answer, so the loss can learn from it as well as from the group's samples::

    loss = (1 - mu) * grpo_loss + mu * sft_loss

`mu` (`guidance_weight`) decays by a cosine from `model.guidance.weight` to `final` over `decay_steps` GRPO
steps (CHORD's global schedule, without its warm-up). The supervised term is the warm start's cross-entropy on the
target tokens (`grpo.sft_loss`). Without guidance (`mu = 0`), GRPO is pure: no target token in any gradient.
"""

from __future__ import annotations

import math


def guidance_weight(grpo_steps: int, start: float, final: float, decay_steps: int) -> float:
    """`mu` after `grpo_steps` GRPO steps: a cosine from `start` to `final` over `decay_steps`, then `final`.

    `decay_steps` 0 keeps `start` throughout.
    """
    if decay_steps <= 0:
        return start
    progress = min(max(grpo_steps, 0) / decay_steps, 1.0)
    return final + (start - final) * 0.5 * (1.0 + math.cos(math.pi * progress))
