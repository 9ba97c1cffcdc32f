"""GRPO math as pure tensor functions: advantages, the clipped policy loss, its aggregation and the SFT loss.

Shapes: ``B`` prompts, ``G`` completions per prompt (``num_generations``), ``N = B*G`` sequences, ``L`` completion
tokens, ``V`` vocabulary. Rewards and sequences are ordered group-major: prompt 0's ``G`` completions come first.
Names follow TRL's ``GRPOTrainer`` where they mean the same thing (``num_generations``, ``scale_rewards``,
``epsilon``, ``epsilon_high``, ``loss_type``, ``max_completion_length``). The KL term to the reference is its own
part (`algorithm/kl.py`), aggregated by the same `aggregate`: TRL adds ``beta * KL`` to each token's loss before
aggregating, and every aggregation here is linear, so the two are the same loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, get_args

import torch
from torch import Tensor

from interleave_model.algorithm.logprobs import token_logprobs
from interleave_model.settings.loss import AdvantageEstimator, LossType, ScaleRewards

SCALE_REWARDS = get_args(ScaleRewards)
ADVANTAGE_ESTIMATORS = get_args(AdvantageEstimator)
LOSS_TYPES = get_args(LossType)


class LossOutput(NamedTuple):
    """Policy loss and its diagnostics. All fields are scalars; all but ``loss`` are detached.

    Attributes:
        loss: The differentiable objective to minimise: the clipped policy-gradient term, aggregated.
        clip_frac: Share of masked tokens whose clipped term was active (the gradient through them is zero).
        ratio_mean: Mean importance ratio ``pi / pi_old`` over masked tokens (1 on the first pass over a rollout).
    """

    loss: Tensor
    clip_frac: Tensor
    ratio_mean: Tensor


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` where ``mask`` is set; 0 where nothing is set (never NaN).

    Values outside the mask are replaced, not multiplied, so an ``inf`` or ``NaN`` there cannot leak in.

    Args:
        x: Values, any shape.
        mask: Bool or 0/1 tensor broadcastable to ``x``.
        dim: Dimension to reduce; ``None`` reduces everything to a scalar.

    Returns:
        The masked mean, ``x`` reduced over ``dim``.
    """
    mask = mask.bool().expand_as(x)
    total = torch.where(mask, x, torch.zeros_like(x)).sum(dim=dim)
    count = mask.sum(dim=dim).clamp(min=1)
    return total / count


def _grouped(rewards: Tensor, num_generations: int) -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B*G], got shape {tuple(rewards.shape)}")
    if num_generations < 2:
        raise ValueError(f"num_generations must be >= 2 (a group needs a baseline), got {num_generations}")
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}")
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    return rewards.to(dtype).view(-1, num_generations)  # [B, G]


def zero_std_groups(rewards: Tensor, num_generations: int) -> Tensor:
    """Groups whose completions all got the same reward: they carry no learning signal.

    Args:
        rewards: ``[B*G]`` rewards, group-major.
        num_generations: ``G``, completions per prompt.

    Returns:
        ``[B]`` bool, True where every reward of the group equals the group's first (exact equality).
    """
    grouped = _grouped(rewards, num_generations)  # [B, G]
    return (grouped == grouped[:, :1]).all(dim=1)  # [B]


def group_advantages(
    rewards: Tensor,
    num_generations: int,
    scale_rewards: ScaleRewards = "group",
    estimator: str = "grpo",
    eps: float = 1e-4,
    sum_over_ranks: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Group-relative advantages: each reward minus a baseline from its own group, optionally scaled.

    The baseline is the group mean (``"grpo"``) or the mean of the other ``G - 1`` completions (``"rloo"``, leave
    one out; equal to ``G / (G - 1) * (r - mean)``). Scaling follows TRL: divide by ``std + eps`` where std is
    ``torch.std``'s default, the unbiased one (``correction=1``), of the rewards of the group (``"group"``) or of the
    whole batch (``"batch"``); ``"none"`` does not scale (Dr. GRPO). A group whose rewards are all equal gets exactly
    zero advantage, whatever the rounding of its mean.

    Args:
        rewards: ``[B*G]`` rewards, group-major.
        num_generations: ``G``, completions per prompt, at least 2.
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"``.
        estimator: ``"grpo"`` or ``"rloo"``.
        eps: Added to the std before dividing.
        sum_over_ranks: The sum of a tensor over every data-parallel rank (the module passes its strategy's
            reduction): ``"batch"`` then divides by the std of every rank's rewards, as one process holding the whole
            batch would. None: this process's rewards are the batch.

    Returns:
        ``[B*G]`` advantages (float32, or float64 for float64 rewards).

    Raises:
        ValueError: On a bad shape, ``num_generations``, ``scale_rewards``, ``estimator`` or ``eps``.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"estimator must be one of {ADVANTAGE_ESTIMATORS}, got {estimator!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    grouped = _grouped(rewards, num_generations)  # [B, G]
    if estimator == "grpo":
        baseline = grouped.mean(dim=1, keepdim=True)  # [B, 1]
    else:
        baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (num_generations - 1)  # [B, G]
    advantages = grouped - baseline  # [B, G]
    if scale_rewards == "group":
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)  # [B, G]
    elif scale_rewards == "batch":
        advantages = advantages / (_batch_std(grouped, sum_over_ranks or (lambda x: x)) + eps)  # [B, G]
    flat = zero_std_groups(rewards, num_generations)[:, None]  # [B, 1]
    advantages = advantages.masked_fill(flat, 0.0)  # [B, G]
    return advantages.reshape(-1)  # [B*G]


def _batch_std(grouped: Tensor, sum_over_ranks: Callable[[Tensor], Tensor]) -> Tensor:
    """The unbiased std (``torch.std``'s) of the rewards of every rank. [B, G] -> scalar."""
    count = sum_over_ranks(grouped.new_tensor(float(grouped.numel())))
    mean = sum_over_ranks(grouped.sum()) / count
    squares = sum_over_ranks((grouped - mean).pow(2).sum())
    return (squares / (count - 1).clamp(min=1.0)).sqrt()


def check_aggregation(
    loss_type: LossType, max_completion_length: int | None = None, num_tokens: float | None = None
) -> None:
    """Refuse an aggregation :func:`aggregate` cannot do. Raises ValueError, naming the argument."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type 'dr_grpo' needs max_completion_length (a constant, not the batch's width)")
    if max_completion_length is not None and max_completion_length < 1:
        raise ValueError(f"max_completion_length must be >= 1, got {max_completion_length}")
    if num_tokens is not None and num_tokens <= 0:
        raise ValueError(f"num_tokens must be > 0, got {num_tokens}")


def aggregate(
    values: Tensor,
    mask: Tensor,
    loss_type: LossType = "grpo",
    max_completion_length: int | None = None,
    num_tokens: float | None = None,
) -> Tensor:
    """A per-token loss as one scalar, by ``loss_type`` (TRL's names). [N, L], [N, L] -> scalar.

    ``"grpo"`` averages tokens within each sequence, then sequences; ``"dr_grpo"`` sums all tokens and divides by the
    constant ``N * max_completion_length`` (a setting, never the batch's width, which would make a token's weight
    depend on how long the other completions ran); ``"dapo"`` averages over all completion tokens of the batch, or
    divides by ``num_tokens`` where given: under data parallelism the token count of every rank divided by the number
    of ranks (DDP averages the ranks' gradients), as TRL does. Values outside ``mask`` are replaced by zero; a row
    with no completion tokens contributes 0 (it still counts in ``"grpo"``'s mean over sequences, as in TRL). Linear
    in ``values``, so the terms of a loss may be aggregated apart and summed.
    """
    mask = mask.bool()  # [N, L]
    values = torch.where(mask, values, torch.zeros_like(values))  # [N, L]
    if loss_type == "grpo":
        return masked_mean(values, mask, dim=1).mean()
    if loss_type == "dr_grpo":
        return values.sum() / (values.shape[0] * max_completion_length)
    return values.sum() / (mask.sum().clamp(min=1) if num_tokens is None else num_tokens)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: LossType = "grpo",
    max_completion_length: int | None = None,
    num_tokens: float | None = None,
    importance_weights: Tensor | None = None,
) -> LossOutput:
    """PPO-clipped GRPO objective.

    Per token: ``-min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)`` with
    ``ratio = exp(logprobs - old_logprobs)``, aggregated by ``loss_type`` (:func:`aggregate`). Positions outside
    ``mask`` are replaced by zero before any ``exp``, so padding garbage cannot produce NaN.

    Args:
        logprobs: ``[N, L]`` log-probs of the completion tokens under the current policy (with grad).
        old_logprobs: ``[N, L]`` log-probs under the policy that sampled them (``logprobs.detach()`` on the first
            pass over a rollout, making ``ratio == 1`` in value but not in gradient).
        advantages: ``[N]`` one advantage per sequence.
        mask: ``[N, L]`` bool or 0/1: the completion tokens that count.
        epsilon: Lower clip range, ratio >= ``1 - epsilon``.
        epsilon_high: Upper clip range (DAPO's clip-higher), ratio <= ``1 + epsilon_high``; defaults to ``epsilon``.
        loss_type, max_completion_length, num_tokens: The aggregation, see :func:`aggregate`.
        importance_weights: ``[N, L]`` weights of each token's policy-gradient term (not of its KL), e.g. the
            truncated ratio correcting for a rollout engine other than the trainer (TRL's TIS); None = 1.

    Returns:
        :class:`LossOutput`.
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if epsilon < 0 or epsilon_high < 0:
        raise ValueError(f"epsilon and epsilon_high must be >= 0, got {epsilon}, {epsilon_high}")
    for name, other in {"old_logprobs": old_logprobs, "mask": mask}.items():
        if other.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(other.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if advantages.shape != (logprobs.shape[0],):
        raise ValueError(f"advantages must be [N], got {tuple(advantages.shape)}")
    check_aggregation(loss_type, max_completion_length, num_tokens)

    # Padding is zeroed at the inputs, before any exp: an inf or NaN there reaches neither the loss nor its gradient.
    mask = mask.bool()  # [N, L]
    zeros = torch.zeros_like(logprobs)  # [N, L]
    logprobs = torch.where(mask, logprobs, zeros)  # [N, L]
    ratio = torch.exp(logprobs - torch.where(mask, old_logprobs, zeros))  # [N, L]
    adv = advantages[:, None].to(ratio.dtype)  # [N, 1]
    unclipped = ratio * adv  # [N, L]
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * adv  # [N, L]
    pg_per_token = -torch.minimum(unclipped, clipped)  # [N, L]
    if importance_weights is not None:
        pg_per_token = pg_per_token * torch.where(mask, importance_weights, zeros)  # [N, L]

    loss = aggregate(pg_per_token, mask, loss_type, max_completion_length, num_tokens)
    with torch.no_grad():
        # clipped in the direction that binds: above the band for A > 0, below it for A < 0
        is_clipped = ((ratio > 1 + epsilon_high) & (adv > 0)) | ((ratio < 1 - epsilon) & (adv < 0))  # [N, L]
        return LossOutput(
            loss=loss,
            clip_frac=masked_mean(is_clipped.float(), mask),
            ratio_mean=masked_mean(ratio, mask),
        )


def sft_loss(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Next-token cross-entropy for the supervised warm-start, chunked like `logprobs.token_logprobs`.

    Args:
        logits: ``[N, L, V]``, already aligned with ``labels``: position ``t`` predicts ``labels[:, t]``.
        labels: ``[N, L]`` target ids, ``ignore_index`` where nothing is learned (prompt, padding).
        ignore_index: Label value that does not count.

    Returns:
        Scalar mean cross-entropy over the counted labels; 0 (still differentiable) when none counts, where
        ``torch.nn.functional.cross_entropy`` would give NaN.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"expected logits [N, L, V] and labels [N, L], got {tuple(logits.shape)}, {tuple(labels.shape)}"
        )
    keep = labels != ignore_index  # [N, L]
    logprobs = token_logprobs(logits, labels.masked_fill(~keep, 0))  # [N, L]
    return -masked_mean(logprobs, keep)


def truncated_importance_weights(trainer_logprobs: Tensor, engine_logprobs: Tensor, cap: float) -> Tensor:
    """Per-token weights `min(exp(trainer - engine), cap)` correcting for sampling on another engine. [N, C] -> [N, C].

    The tokens were drawn from the engine's distribution; the loss assumes the trainer's. The ratio reweights each
    token to the trainer's policy, truncated so that a token the engine found far likelier cannot dominate (TIS).
    No gradient flows through the weights.
    """
    return torch.exp(trainer_logprobs.detach() - engine_logprobs).clamp(max=cap)
