"""The KL term to the frozen reference (`model.kl`), a part of the GRPO loss beside the clipped policy term.

``beta`` times a per-token estimate of KL(pi || ref) on the sampled completion tokens, aggregated as the policy loss
aggregates its tokens (`grpo.aggregate`); TRL adds ``beta * KL`` to each token's loss before aggregating, the same
loss since every aggregation is linear. The reference is the policy as GRPO starts: the base with the adapter off
under LoRA, else a frozen copy (`model/policy.py`).

Estimators (Schulman, "Approximating KL divergence", 2020): ``k1`` estimates KL(pi || ref) without bias but, as a
loss term on tokens sampled from pi, its expected gradient is zero (it is the score function's mean), so
``beta * k1`` regularises nothing; ``k3`` (TRL's) and ``k2`` have gradients that pull pi toward the reference. ``k1``
remains useful as a measurement.
"""

from __future__ import annotations

from typing import NamedTuple, get_args

import torch
from torch import Tensor

from interleave_model.algorithm.grpo import aggregate, masked_mean
from interleave_model.settings.loss import KlEstimator, LossType

KL_ESTIMATORS = get_args(KlEstimator)


class KlOutput(NamedTuple):
    """The KL term: ``loss`` (differentiable, aggregated like the policy loss, before ``beta``) and ``kl``, the mean
    per-token estimate over the masked tokens (detached)."""

    loss: Tensor
    kl: Tensor


def kl_divergence(logprobs: Tensor, ref_logprobs: Tensor, estimator: KlEstimator = "k3") -> Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi. [N, L], [N, L] -> [N, L].

    With ``log_ratio = ref_logprobs - logprobs``: ``k1 = -log_ratio`` (unbiased, can be negative),
    ``k2 = 0.5 * log_ratio**2`` (biased, >= 0), ``k3 = exp(log_ratio) - log_ratio - 1`` (unbiased, >= 0; TRL's).

    Unbiased as values, not as gradients: differentiated through ``logprobs`` on tokens sampled from pi, k1's
    expected gradient is ``sum_x pi(x) grad log pi(x) = grad sum_x pi(x) = 0``, so k1 as a loss term pulls nothing
    toward the reference. k3's expected gradient with respect to the logits is ``pi - ref``, k2's that of
    KL(pi || ref).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"shape mismatch: logprobs {tuple(logprobs.shape)}, ref {tuple(ref_logprobs.shape)}")
    log_ratio = ref_logprobs - logprobs  # [N, L]
    if estimator == "k1":
        return -log_ratio  # [N, L]
    if estimator == "k2":
        return 0.5 * log_ratio**2  # [N, L]
    return torch.exp(log_ratio) - log_ratio - 1  # [N, L]


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    estimator: KlEstimator = "k3",
    loss_type: LossType = "grpo",
    max_completion_length: int | None = None,
    num_tokens: float | None = None,
) -> KlOutput:
    """The KL term of a micro-batch of completions. [N, L] x 3 -> :class:`KlOutput`.

    Args:
        logprobs: ``[N, L]`` log-probs of the completion tokens under the policy (with grad).
        ref_logprobs: ``[N, L]`` log-probs of the same tokens under the reference.
        mask: ``[N, L]`` bool or 0/1: the completion tokens that count. Positions outside it are replaced by zero
            before any ``exp``, so padding garbage cannot produce NaN.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``, see :func:`kl_divergence`.
        loss_type, max_completion_length, num_tokens: The policy loss's aggregation (`grpo.aggregate`).
    """
    mask = mask.bool()  # [N, L]
    zeros = torch.zeros_like(logprobs)  # [N, L]
    per_token = kl_divergence(torch.where(mask, logprobs, zeros), torch.where(mask, ref_logprobs, zeros), estimator)
    loss = aggregate(per_token, mask, loss_type, max_completion_length, num_tokens)
    return KlOutput(loss, masked_mean(per_token.detach(), mask))
