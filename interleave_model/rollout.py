"""Grouped sampling: P prompts x G completions, each prompt prefilled once and its KV cache shared by its group."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor
from transformers import DynamicCache


class Rollout(NamedTuple):
    """The completions of one batch, group-major: rows g*G .. g*G+G-1 answer prompt g."""

    prompt_ids: Tensor  # [P*G, Lp] left-padded
    prompt_mask: Tensor  # [P*G, Lp] 1 = real token
    completion_ids: Tensor  # [P*G, C] right-padded with pad after EOS
    completion_mask: Tensor  # [P*G, C] 1 = generated token up to and including EOS
    truncated: Tensor  # [P*G] bool: the budget ran out before EOS
    texts: list[str]  # decoded completions, special tokens removed


def token_budget(target_lengths: Sequence[int], margin: float = 0.25, slack: int = 4) -> int:
    """New tokens to allow for a batch: the longest target's token count plus a margin, plus EOS and some slack.

    The budget follows the batch, so a 10-word stage never pays for a 500-word budget and no stage truncates a
    correct answer (the longest target fits with `margin` to spare).
    """
    return math.ceil(max(target_lengths) * (1.0 + margin)) + 1 + slack


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    num_generations: int,
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sample `num_generations` completions per prompt; temperature 0 means greedy.

    Args:
        model: A causal LM taking `input_ids, attention_mask, position_ids, past_key_values, use_cache`.
        prompt_ids: Left-padded prompts, [P, Lp].
        prompt_mask: 1 for real prompt tokens, [P, Lp].

    Returns:
        `(completion_ids [P*G, C], completion_mask [P*G, C], truncated [P*G])`, C <= max_new_tokens.
    """
    was_training = model.training
    model.eval()  # dropout off while sampling, so the rollout is drawn from the policy being scored
    try:
        G = num_generations
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # [P, Lp]
        cache = DynamicCache()
        out = model(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        if G > 1:
            cache.batch_repeat_interleave(G)
        logits = out.logits[:, -1].repeat_interleave(G, dim=0)  # [P*G, V]
        attention = prompt_mask.repeat_interleave(G, dim=0)  # [P*G, Lp]
        position = positions[:, -1:].repeat_interleave(G, dim=0)  # [P*G, 1]
        finished = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)  # [P*G]
        tokens: list[Tensor] = []
        for _ in range(max_new_tokens):
            token = _pick(logits, temperature, top_p, top_k, generator)  # [P*G]
            token = torch.where(finished, torch.full_like(token, pad_token_id), token)
            tokens.append(token)
            finished |= token == eos_token_id
            if bool(finished.all()):
                break
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            position = position + 1
            out = model(
                input_ids=token[:, None],
                attention_mask=attention,
                position_ids=position,
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1]
        completion_ids = torch.stack(tokens, dim=1)  # [P*G, C]
        completion_mask = _mask_through_eos(completion_ids, eos_token_id)  # [P*G, C]
        return completion_ids, completion_mask, ~finished
    finally:
        model.train(was_training)


def rollout(model: torch.nn.Module, tokenizer, prompt_ids: Tensor, prompt_mask: Tensor, **kwargs) -> Rollout:
    """`sample` plus the bookkeeping the loss needs: repeated prompts and decoded texts."""
    G = kwargs["num_generations"]
    completion_ids, completion_mask, truncated = sample(
        model,
        prompt_ids,
        prompt_mask,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **kwargs,
    )
    texts = tokenizer.batch_decode(completion_ids * completion_mask, skip_special_tokens=True)
    return Rollout(
        prompt_ids=prompt_ids.repeat_interleave(G, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(G, dim=0),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        truncated=truncated,
        texts=[" ".join(t.split()) for t in texts],
    )


def _pick(logits: Tensor, temperature: float, top_p: float, top_k: int, generator: torch.Generator | None) -> Tensor:
    """Next token per row from `logits` [N, V]: argmax at temperature 0, else a sample after top-k / top-p."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature  # [N, V]
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass (the first always stays)
        drop = (probs.cumsum(-1) - probs) > top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


def _mask_through_eos(completion_ids: Tensor, eos_token_id: int) -> Tensor:
    """1 for every token up to and including the first EOS of its row, 0 after it. [N, C] -> [N, C] long."""
    is_eos = (completion_ids == eos_token_id).long()  # [N, C]
    eos_before = is_eos.cumsum(-1) - is_eos  # EOS tokens strictly before each position
    return (eos_before == 0).long()
