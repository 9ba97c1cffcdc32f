"""The known answer as one more member of each group (`model.reference_in_group`): LUFFY's off-policy guidance
(Yan et al. 2025, "Learning to Reason under Off-Policy Guidance", arXiv 2504.14945).

The known answer joins each group with its own reward (`mixed_group_advantages`), so the group's baseline includes
it and every sample that falls short of it is pushed down, and its tokens are learned through policy shaping
(`shaped_reference_loss`): the importance ratio against an expert of probability 1 is the policy's probability p
itself, shaped as ``p / (p + gamma)`` so that a token the policy finds unlikely still gets a gradient
(``gamma / (p + gamma)**2``) rather than the vanishing one of ``p``; no clipping acts on it. The loss is
``G / (G + 1)`` of GRPO's on the samples plus ``1 / (G + 1)`` of the reference's (`samples_share`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from interleave_model.algorithm.grpo import group_advantages
from interleave_model.algorithm.logprobs import token_logprobs
from interleave_model.settings import ScaleRewards


def samples_share(num_generations: int) -> float:
    """The samples' share of the loss, ``G / (G + 1)``: the reference is one member of ``G + 1``."""
    return num_generations / (num_generations + 1)


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
