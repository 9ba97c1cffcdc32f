"""Reference guidance: the known target teaches beside GRPO, CHORD-phi (Zhang et al. 2025, "On-Policy RL Meets
Off-Policy Experts: Harmonizing Supervised Fine-Tuning and Reinforcement Learning via Dynamic Weighting",
arXiv 2508.11408).

Every prompt of this task has its answer, so the loss can learn from it as well as from the group's samples::

    loss = (1 - mu) * grpo_loss + mu * phi_sft_loss

`mu` (`guidance_weight`) decays by a cosine from `guidance` to `guidance_final` over `guidance_decay_steps` GRPO
steps (CHORD's global schedule, without its warm-up). The supervised term weighs each target token by
``phi = p * (1 - p)`` (CHORD-phi, p the policy's probability of the token, no gradient through phi): tokens the policy
already predicts (p near 1) and tokens far from anything it would say (p near 0) teach little, so the expert data
shapes the policy where it is uncertain rather than overwriting it. `loss.guidance_loss: ce` takes the plain
cross-entropy instead (`grpo.sft_loss`, the warm start's; CHORD-mu in the paper). `mu = 0` is pure GRPO: no target
token in any gradient.

The other way in (`loss.reference_in_group`), LUFFY's off-policy guidance (Yan et al. 2025, "Learning to Reason
under Off-Policy Guidance", arXiv 2504.14945): the known answer joins each group as one more member with its own
reward (`mixed_group_advantages`), so the group's baseline includes it and every sample that falls short of it is
pushed down, and its tokens are learned through policy shaping (`shaped_reference_loss`): the importance ratio
against an expert of probability 1 is the policy's probability p itself, shaped as ``p / (p + gamma)`` so that a
token the policy finds unlikely still gets a gradient (``gamma / (p + gamma)**2``) rather than the vanishing one of
``p``; no clipping acts on it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from interleave_model.algorithm.grpo import group_advantages, masked_mean
from interleave_model.algorithm.logprobs import token_logprobs
from interleave_model.settings import ScaleRewards


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


def mixed_group_advantages(
    rewards: Tensor,
    reference_rewards: Tensor,
    num_generations: int,
    scale_rewards: ScaleRewards = "group",
    estimator: str = "grpo",
) -> tuple[Tensor, Tensor]:
    """Advantages of each group with the known answer as one more member (LUFFY). [P*G], [P] -> [P*G], [P].

    Each group's G samples and its reference are scored together by `grpo.group_advantages` over ``G + 1``
    members; the samples' advantages come back group-major as `rewards` came in, the references' one per prompt.
    """
    P, G = reference_rewards.shape[0], num_generations
    mixed = torch.cat([rewards.view(P, G), reference_rewards.view(P, 1).to(rewards)], dim=1)  # [P, G+1]
    advantages = group_advantages(mixed.flatten(), G + 1, scale_rewards, estimator).view(P, G + 1)  # [P, G+1]
    return advantages[:, :G].flatten(), advantages[:, G]


def shaped_reference_loss(logits: Tensor, labels: Tensor, advantages: Tensor, gamma: float, ignore_index: int = -100):
    """LUFFY's off-policy term: ``-A * p / (p + gamma)`` on each reference token, the mean over a row's tokens, then
    over rows (as the "grpo" loss averages a completion). [N, L, V], [N, L], [N] -> scalar.

    Args:
        logits: ``[N, L, V]``, aligned with ``labels``: position ``t`` predicts ``labels[:, t]``.
        labels: ``[N, L]`` the reference's ids, ``ignore_index`` where nothing is learned.
        advantages: ``[N]`` each reference's advantage in its group (`mixed_group_advantages`).
        gamma: The shaping constant, > 0 (LUFFY's 0.1).
        ignore_index: Label value that does not count.
    """
    keep = labels != ignore_index  # [N, L]
    p = token_logprobs(logits, labels.masked_fill(~keep, 0)).exp()  # [N, L]
    shaped = p / (p + gamma)  # [N, L]
    per_row = (shaped * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1)  # [N]
    return -(advantages.to(per_row) * per_row).mean()
