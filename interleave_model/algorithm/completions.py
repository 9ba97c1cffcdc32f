"""A completion's token log-probs (and entropies) under a model, in micro-batches if asked.

A completion goes through the fused LM head (`logprobs.head_token_logprobs`) when the model has a plain one, else
through its logits; rows that share a prompt in groups of G forward that prompt once. Shapes: ``N`` rows, ``C``
completion tokens, ``V`` vocabulary, ``H`` hidden size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache

from interleave_model.algorithm.logprobs import head_token_logprobs, token_entropy, token_logprobs
from interleave_model.generation.rollout_cache import plain_layers
from interleave_model.model.positions import model_positions

# What one more forward and backward through the decoder costs beside its tokens, in completion tokens: a
# sub-batch of short completions pays it to skip the padding to a long one (`length_buckets`). SmolLM2-135M with
# LoRA on a 2-thread CPU: ~5.5 ms a token and ~0.35 s a call (2 rows of 2 tokens 0.8-0.95 s, 1 row of 8 0.6 s).
# An accelerator runs a token for far less beside its per-call launches; its figure is an estimate (not measured)
# that cuts only long runs of padding, such as a long stage's few completions at the budget.
SUB_BATCH_TOKENS = {"cpu": 64}
ACCELERATOR_SUB_BATCH_TOKENS = 512


def completion_logits(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, width: int) -> Tensor:
    """Logits that predict the last `width` tokens of each row (the completion), [N, width, V]."""
    positions = model_positions(model, input_ids, attention_mask, input_ids.shape[1] - width)  # [N, L]
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        logits_to_keep=width + 1,
        use_cache=False,  # else the forward keeps a copy of every layer's keys and values
    )
    return out.logits[:, :-1]  # position t predicts token t+1, so drop the last


def completion_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_ids: Tensor,
    temperature: float,
    with_entropy: bool = False,
    group_size: int = 1,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of the completion (the last C tokens of each row) and, when asked, the entropies: [N, C] each.

    Through the fused LM head (`head_token_logprobs`) when the model has a plain one: only the completion
    tokens go through the head, and no [N, C, V] logits (nor their gradient) are ever held; positions past the
    completion mask get 0. Otherwise from the model's logits.

    `group_size` G > 1 says that rows come in groups of G with one prompt (a GRPO rollout): when they really do, each
    prompt goes through the decoder once and its keys and values serve the G completions (`completion_hidden`).

    Columns past every row's completion (a micro-batch of rows that stopped before the batch's longest) are cut
    before the forward and given 0 after it: a causal model's values at the others are the same without them.
    """
    width = completion_ids.shape[1]
    cut = width - used_width(attention_mask[:, -width:])
    if cut == 0:
        return _completion_logprobs(model, input_ids, attention_mask, completion_ids, temperature, with_entropy,
                                    group_size)  # fmt: skip
    logprobs, entropy = _completion_logprobs(
        model, input_ids[:, :-cut], attention_mask[:, :-cut], completion_ids[:, :-cut], temperature, with_entropy,
        group_size,
    )  # fmt: skip
    # the cut columns are masked in every row: log-probs and entropies 0 there
    return F.pad(logprobs, (0, cut)), None if entropy is None else F.pad(entropy, (0, cut))


def _completion_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_ids: Tensor,
    temperature: float,
    with_entropy: bool,
    group_size: int,
) -> tuple[Tensor, Tensor | None]:
    """`completion_logprobs` on completions whose last column some row uses: [N, C] each."""
    width = completion_ids.shape[1]
    head = fused_head(model)
    if head is None:
        logits = completion_logits(model, input_ids, attention_mask, width)  # [N, C, V]
        entropy = token_entropy(logits.detach(), temperature) if with_entropy else None  # [N, C]
        return token_logprobs(logits, completion_ids, temperature), entropy
    decoder, weight = head
    hidden = completion_hidden(decoder, input_ids, attention_mask, width, group_size)  # [N, C, H]
    keep = attention_mask[:, -width:].bool()  # [N, C], the completion mask
    logprobs, entropy = head_token_logprobs(
        hidden[keep], weight, completion_ids[keep], temperature, with_entropy=with_entropy
    )  # [K] each
    logprobs = torch.zeros_like(keep, dtype=logprobs.dtype).masked_scatter(keep, logprobs)  # [N, C]
    if entropy is not None:
        entropy = torch.zeros_like(keep, dtype=entropy.dtype).masked_scatter(keep, entropy)  # [N, C]
    return logprobs, entropy


def completion_hidden(
    decoder: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, width: int, group_size: int = 1
) -> Tensor:
    """The decoder's last hidden states at the positions that predict the last `width` tokens: [N, width, H].

    With `group_size` G > 1 and rows whose prompts (all but the last `width` tokens) agree within each group of G,
    the prompts run once, P = N / G rows, and their cached keys and values, repeated G times, are attended by the
    completions. The gradient reaches the prompt's positions through the repeated cache (summed over the G copies),
    so log-probs and gradients equal those of the full forward; a rollout's prompt tokens are most of a short
    stage's tokens, so the update does up to G times less prompt work. The completions then run in sub-batches of
    similar length (`length_buckets`), each padded only to its own longest, when the model's cache is a plain one:
    a group whose completions range from a few tokens to the budget no longer runs every row to the budget.
    """
    positions = model_positions(decoder, input_ids, attention_mask, input_ids.shape[1] - width)  # [N, L]
    # under gradient checkpointing HF trains without a cache, so the prompt's keys and values cannot be handed on
    checkpointing = decoder.training and getattr(decoder, "gradient_checkpointing", False)
    if checkpointing or not shares_prompts(input_ids, attention_mask, width, group_size):
        hidden = decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False
        ).last_hidden_state  # [N, L, H]
        return hidden[:, -width - 1 : -1]  # position t predicts token t+1
    G, prompt = group_size, input_ids.shape[1] - width
    firsts = slice(None, None, G)  # one row per group
    prefix = decoder(
        input_ids=input_ids[firsts, :prompt],
        attention_mask=attention_mask[firsts, :prompt],
        position_ids=positions[firsts, :prompt],
        use_cache=True,
    )  # last_hidden_state [P, Lp, H]
    return _completions_after(decoder, prefix, input_ids, attention_mask, positions, width, G)


def _completions_after(
    decoder: torch.nn.Module, prefix, input_ids: Tensor, attention_mask: Tensor, positions: Tensor, width: int, G: int
) -> Tensor:
    """`completion_hidden`'s completions on their prompts' forward `prefix` (hidden states and cache of P rows), in
    sub-batches of similar length (`length_buckets`): [N, width, H], rows in their own order."""
    prompt = input_ids.shape[1] - width
    lengths = attention_mask[:, prompt:].sum(dim=1).tolist()  # [N] completion tokens (right-padded)
    cache = prefix.past_key_values
    overhead = SUB_BATCH_TOKENS.get(input_ids.device.type, ACCELERATOR_SUB_BATCH_TOKENS)
    # a cache with special layers: one batch, the cache repeated in place
    buckets = length_buckets(lengths, overhead) if plain_layers(cache) else [list(range(len(lengths)))]
    parts, order = [], []
    for rows in buckets:
        index = torch.tensor(rows, device=input_ids.device)  # [n]
        groups = index // G  # [n], each row's prompt
        used = max(1, max(lengths[r] for r in rows))
        if len(buckets) == 1:  # the rows in order: the cache repeated in place, no copy per bucket
            cache.batch_repeat_interleave(G)  # [P, ...] -> [N, ...], differentiable
            rows_cache = cache
        else:
            rows_cache = DynamicCache([(layer.keys[groups], layer.values[groups]) for layer in cache.layers])
        hidden = [prefix.last_hidden_state[groups, -1:]]  # [n, 1, H]: predicts the first token
        if used > 1:
            columns = slice(prompt, prompt + used - 1)
            hidden.append(
                decoder(
                    input_ids=input_ids[index, columns],
                    attention_mask=attention_mask[index, : prompt + used - 1],
                    position_ids=positions[index, columns],
                    past_key_values=rows_cache,
                    use_cache=True,
                ).last_hidden_state  # [n, used-1, H]
            )
        parts.append(F.pad(torch.cat(hidden, dim=1), (0, 0, 0, width - used)))  # [n, width, H]
        order += rows
    hidden = torch.cat(parts)  # [N, width, H], rows in bucket order
    if order != sorted(order):
        hidden = hidden[torch.tensor(order, device=hidden.device).argsort()]
    return hidden


def length_buckets(lengths: Sequence[int], overhead: int) -> list[list[int]]:
    """The rows (indices into `lengths`) in sub-batches that each run padded to their own longest completion.

    Sorted by length, the rows are cut into runs so that the padded tokens plus `overhead` per run are fewest (an
    exact dynamic programme over the cuts); one run keeps the rows' own order.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # longest first: a run's first row is its longest
    n = len(order)
    # cost[j]: the cheapest cut of the first j rows; cut[j]: where its last run starts
    cost, cut = [0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            c = cost[i] + (j - i) * lengths[order[i]] + overhead
            if c < cost[j]:
                cost[j], cut[j] = c, i
    runs, j = [], n
    while j > 0:
        runs.append(order[cut[j] : j])
        j = cut[j]
    return [list(range(n))] if len(runs) <= 1 else runs[::-1]


def used_width(completion_mask: Tensor) -> int:
    """Columns up to the last one any row's completion uses (right-padded completions): at least 1."""
    used = completion_mask.any(dim=0).nonzero()
    return max(1, int(used[-1]) + 1) if used.numel() else 1


def shares_prompts(input_ids: Tensor, attention_mask: Tensor, width: int, group_size: int) -> bool:
    """True when the N rows form groups of `group_size` > 1 whose prompts (all but the last `width` tokens, and
    their mask) are equal, with at least one completion token to run after them."""
    n, length = input_ids.shape
    if group_size < 2 or n % group_size or width < 2 or length <= width:
        return False
    prompt = input_ids[:, :-width].reshape(n // group_size, group_size, -1)  # [P, G, Lp]
    mask = attention_mask[:, :-width].reshape(n // group_size, group_size, -1)  # [P, G, Lp]
    return bool((prompt == prompt[:, :1]).all() and (mask == mask[:, :1]).all())


# the families whose logits are exactly the final hidden states times the output layer's weight; others may cap,
# scale or bias their logits and go through the plain logits path
FUSED_HEAD_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def fused_head(model: torch.nn.Module) -> tuple[torch.nn.Module, Tensor] | None:
    """(decoder, LM-head weight) of a model whose logits are exactly `decoder(...) @ weight.T`, else None."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in FUSED_HEAD_FAMILIES:
        return None  # other families may cap, scale or bias their logits
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None or type(head.weight) is not torch.nn.Parameter:
        return None  # an adapter on the head, or a sharded (DTensor) weight
    return model.get_decoder(), head.weight


def row_chunks(n_rows: int, size: int | None) -> list[slice]:
    """Slices of at most `size` rows (`micro_batch_size`) covering `n_rows`; None means one slice of all."""
    size = size or n_rows
    return [slice(i, min(i + size, n_rows)) for i in range(0, n_rows, size)]


def chunked_completion_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_ids: Tensor,
    temperature: float,
    micro_batch_size: int | None,
    group_size: int = 1,
) -> Tensor:
    """`completion_logprobs` (without entropies) taken `micro_batch_size` rows at a time: [N, C]."""
    chunks = [
        completion_logprobs(
            model, input_ids[rows], attention_mask[rows], completion_ids[rows], temperature, group_size=group_size
        )[0]
        for rows in row_chunks(input_ids.shape[0], micro_batch_size)
    ]
    return torch.cat(chunks)  # [N, C]
