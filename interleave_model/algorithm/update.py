"""One update's backward passes, taken `micro_batch_size` rows at a time: the clipped policy loss with the KL term on
a trajectory, and the cross-entropy on the known answers (the warm start's loss, and guidance's term).

Each chunk counts by its share of the whole batch's aggregate, so the gradient is the whole batch's whatever the chunk
size: all rows at once would hold all their activations (8.3 GB for 16 pairs of SmolLM2 at 10 words, 5.1 GB in chunks
of 8). `backward` is the caller's (Lightning's `manual_backward`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from interleave_model.algorithm import grpo
from interleave_model.algorithm.completions import completion_logits, completion_logprobs, row_chunks
from interleave_model.algorithm.loss import GRPOLoss
from interleave_model.algorithm.records import Trajectory
from interleave_model.algorithm.supervised import sft_inputs


def policy_backward(
    policy: torch.nn.Module,
    trajectory: Trajectory,
    loss: GRPOLoss,
    backward: Callable[[Tensor], None],
    *,
    temperature: float,
    num_generations: int,
    micro_batch_size: int | None,
    weight: float = 1.0,
    num_tokens: float | None = None,
    importance_cap: float | None = None,
) -> dict[str, float]:
    """Backward of `weight` times `loss` (the clipped policy term, plus the KL term where the trajectory has reference
    log-probs) on `trajectory` with its advantages.

    Args:
        temperature, num_generations: How the policy scores the completions (`completion_logprobs`).
        num_tokens: "dapo"'s normaliser (`GRPOLoss`).
        importance_cap: Where the rollout came from another engine, its log-probs correct the policy term, truncated
            at this cap (TIS, `grpo.truncated_importance_weights`); None = no correction.

    Returns:
        The update's statistics: loss (weighted), pg_loss, clip_frac and entropy; kl where the reference counts; the
        engine's log-prob gap to the trainer's where the engine recorded log-probs. Per-token statistics are
        token-weighted over the chunks.
    """
    mask = trajectory.completion_mask.float()  # [N, C]
    n_rows, total_tokens = mask.shape[0], mask.sum().clamp(min=1.0)
    totals = {"loss": 0.0, "pg_loss": 0.0, "clip_frac": 0.0, "entropy": 0.0}
    reference, engine = trajectory.ref_logprobs, trajectory.rollout.logprobs  # [N, C] each, or None
    if reference is not None:
        totals["kl"] = 0.0
    if engine is not None:  # how far the engine's numerics are from the trainer's (the off-policy gap)
        totals["engine_logprob_gap"] = 0.0
    for rows in row_chunks(n_rows, micro_batch_size):
        ids, attention = trajectory.input_ids[rows], trajectory.attention_mask[rows]
        logprobs, entropy = completion_logprobs(policy, ids, attention, trajectory.completion_ids[rows], temperature,
                                                with_entropy=True, group_size=num_generations)  # fmt: skip
        old = trajectory.old_logprobs[rows] if trajectory.old_logprobs is not None else logprobs.detach()
        weights = None
        if importance_cap is not None:
            weights = grpo.truncated_importance_weights(old, engine[rows], importance_cap)
        terms = loss(logprobs=logprobs, old_logprobs=old, advantages=trajectory.advantages[rows], mask=mask[rows],
                     ref_logprobs=None if reference is None else reference[rows], importance_weights=weights,
                     num_tokens=num_tokens)  # fmt: skip
        share, token_share = loss.share(rows, n_rows), (mask[rows].sum() / total_tokens).item()
        if terms.kl is not None:
            totals["kl"] += terms.kl.kl.item() * token_share
        backward(terms.loss * share * weight)
        totals["loss"] += terms.loss.item() * share * weight
        totals["pg_loss"] += terms.policy.loss.item() * share
        totals["clip_frac"] += terms.policy.clip_frac.item() * token_share
        totals["entropy"] += grpo.masked_mean(entropy, mask[rows]).item() * token_share
        if engine is not None:  # `old` is the trainer's log-probs of the weights that sampled
            gap = grpo.masked_mean((old - engine[rows]).abs(), mask[rows])
            totals["engine_logprob_gap"] += gap.item() * token_share
    return totals


def target_backward(
    policy: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    batch: dict,
    device: torch.device,
    micro_batch_size: int | None,
    backward: Callable[[Tensor], None],
    weight: float = 1.0,
) -> float:
    """Backward of `weight` times the policy's cross-entropy on the batch's known answers (and EOS); the loss's value.

    Each chunk's mean over its target tokens counts by its share of the batch's target tokens.
    """
    input_ids, attention_mask, labels = sft_inputs(tokenizer, batch, device)  # [B, Lp+T], [B, T]
    counted = labels != -100  # [B, T]
    n_rows, n_tokens = labels.shape[0], counted.sum().clamp(min=1)
    total = 0.0
    for rows in row_chunks(n_rows, micro_batch_size):
        logits = completion_logits(policy, input_ids[rows], attention_mask[rows], width=labels.shape[1])  # [b, T, V]
        loss = grpo.sft_loss(logits, labels[rows]) * (counted[rows].sum() / n_tokens).item()
        backward(loss * weight)
        total += loss.item()
    return total
