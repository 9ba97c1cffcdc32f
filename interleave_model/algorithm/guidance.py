"""Reference guidance: the known target teaches beside GRPO, CHORD-phi (Zhang et al. 2025, "On-Policy RL Meets
Off-Policy Experts: Harmonizing Supervised Fine-Tuning and Reinforcement Learning via Dynamic Weighting",
arXiv 2508.11408).

Every prompt of this task has its answer, so the loss can learn from it as well as from the group's samples::

    loss = (1 - mu) * grpo_loss + mu * phi_sft_loss

`mu` (`guidance_weight`) decays by a cosine from `model.guidance.weight` to `final` over `decay_steps` GRPO
steps (CHORD's global schedule, without its warm-up). The supervised term weighs each target token by
``phi = p * (1 - p)`` (CHORD-phi, p the policy's probability of the token, no gradient through phi): tokens the policy
already predicts (p near 1) and tokens far from anything it would say (p near 0) teach little, so the expert data
shapes the policy where it is uncertain rather than overwriting it. `model.guidance.loss: ce` takes the plain
cross-entropy instead (`grpo.sft_loss`, the warm start's; CHORD-mu in the paper). Without guidance (`mu = 0`),
GRPO is pure: no target token in any gradient.
"""

from __future__ import annotations

import math

from torch import Tensor

from interleave_model.algorithm.grpo import masked_mean, sft_loss
from interleave_model.algorithm.logprobs import token_logprobs
from interleave_model.settings import GuidanceLoss


def guidance_weight(grpo_steps: int, start: float, final: float, decay_steps: int) -> float:
    """`mu` after `grpo_steps` GRPO steps: a cosine from `start` to `final` over `decay_steps`, then `final`.

    `decay_steps` 0 keeps `start` throughout.
    """
    if decay_steps <= 0:
        return start
    progress = min(max(grpo_steps, 0) / decay_steps, 1.0)
    return final + (start - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


def phi_sft_loss(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Cross-entropy on the target tokens, each weighted by ``p * (1 - p)`` of the policy (detached). [N, L, V], [N, L]
    -> scalar, the mean over the counted tokens (0 when none counts).

    Args:
        logits: ``[N, L, V]``, aligned with ``labels``: position ``t`` predicts ``labels[:, t]``.
        labels: ``[N, L]`` target ids, ``ignore_index`` where nothing is learned.
        ignore_index: Label value that does not count.
    """
    keep = labels != ignore_index  # [N, L]
    logprobs = token_logprobs(logits, labels.masked_fill(~keep, 0))  # [N, L]
    p = logprobs.detach().exp()  # [N, L]
    return -masked_mean(p * (1.0 - p) * logprobs, keep)


def supervised_loss(name: GuidanceLoss):
    """The supervised term `model.guidance.loss` names: `phi_sft_loss` ("phi") or the plain `grpo.sft_loss` ("ce");
    ``(logits [N, L, V], labels [N, L]) -> scalar``."""
    return phi_sft_loss if name == "phi" else sft_loss
