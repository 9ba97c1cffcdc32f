"""Speculative sampling from a lookup draft: k drafted tokens scored in one forward, exact in distribution.

Every interleaving answer is made of words the model was given, so a draft that copies them costs nothing and, once
the policy interleaves, is mostly right. Each decode step feeds the last sampled token and k drafted ones; the model's
distributions at those k + 1 positions decide, row by row, how many drafted tokens are kept, and one more token is
drawn. With a draft that puts all its mass on one token x, the rule of Leviathan et al. (2023, arXiv 2211.17192) and
Chen et al. (2023, arXiv 2302.01318) keeps x with probability p(x) and otherwise draws from p with x removed and
renormalised, so every kept token is distributed as a plain decode step would draw it: the sampled sequences have
the model's distribution exactly (`tests/model/generation/test_speculative.py` checks it statistically). At
temperature 0 a drafted token is kept when it is the argmax, so greedy output is unchanged.

Rows keep different numbers of tokens: each row has its own position, and a rejected token's cache entry stays in the
buffer with its attention mask set to 0 (`GroupLayer.compact` squeezes such holes out when the buffer fills).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from interleave_model.generation.rollout import _draw, _mask_through_stop, _pick, _uniform, prefill
from interleave_model.generation.sampling_params import SamplingParams
from interleave_model.model.positions import model_positions


class Lookup:
    """Drafts for each row: the continuation, in the row's source tokens, of the longest suffix of its answer (at most
    `ngram` tokens) found there, the occurrence at or after the last one used first; the source's first tokens for an
    empty answer or no match.

    Args:
        sources: Each row's tokens to copy from (e.g. its target, or its prompt), each ending where the answer should
            end (a stop token appended by the caller).
        ngram: Longest suffix looked up.
        k: Tokens drafted per step.
        filler: Drafted where the source runs out.
    """

    def __init__(self, sources: Sequence[Sequence[int]], ngram: int, k: int, filler: int) -> None:
        self.sources = [list(source) for source in sources]
        self.ngram, self.k, self.filler = ngram, k, filler
        self.index: list[dict[tuple[int, ...], list[int]]] = []
        for source in self.sources:
            index: dict[tuple[int, ...], list[int]] = {}
            for m in range(1, ngram + 1):
                for end in range(m, len(source) + 1):
                    index.setdefault(tuple(source[end - m : end]), []).append(end)
            self.index.append(index)
        self.cursor = [0] * len(self.sources)  # where each row's last match ended

    def select(self, rows: Sequence[int]) -> None:
        """Keep the rows `rows` (indices into the current rows), as the sampler retires the others."""
        for name in ("sources", "index", "cursor"):
            values = getattr(self, name)
            setattr(self, name, [values[r] for r in rows])

    def draft(self, answers: Sequence[Sequence[int]]) -> list[list[int]]:
        """k tokens for each row from its answer so far."""
        drafts = []
        for row, answer in enumerate(answers):
            source, index, start = self.sources[row], self.index[row], 0
            for m in range(min(self.ngram, len(answer)), 0, -1):
                ends = index.get(tuple(answer[-m:]))
                if ends:
                    later = [end for end in ends if end >= self.cursor[row]]
                    start = later[0] if later else ends[0]
                    break
            self.cursor[row] = start
            tokens = source[start : start + self.k]
            drafts.append(tokens + [self.filler] * (self.k - len(tokens)))
        return drafts


def _sampling_probs(logits: Tensor, temperature: float, top_p: float, top_k: int) -> Tensor:
    """The distribution a plain decode step samples from: softmax(logits / temperature) after top-k and top-p, in
    float32 (the cuts as `rollout._pick` makes them). [..., V] -> [..., V]."""
    x = logits.float() / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -torch.inf)
    if top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        drop = (probs.cumsum(-1) - probs) > top_p
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, -torch.inf))
    return x.softmax(-1)


def verify(
    logits: Tensor, drafts: Tensor, temperature: float, top_p: float, top_k: int, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """How many drafted tokens each row keeps, and the token drawn after them.

    Args:
        logits: The model's logits at the last sampled token and at each drafted one, [R, k+1, V].
        drafts: The drafted tokens, [R, k].

    Returns:
        `(kept [R], next_token [R])`: drafts[:, :kept] are kept; at temperature 0 `next_token` is the argmax after
        them, else a draw from the model's distribution there, with the rejected drafted token removed (none removed
        when all k were kept).
    """
    R, k = drafts.shape
    rows = torch.arange(R, device=logits.device)
    if temperature == 0:
        best = logits.argmax(-1)  # [R, k+1]
        kept = (best[:, :k] == drafts).long().cumprod(-1).sum(-1)  # [R] leading matches
        return kept, best.gather(-1, kept[:, None])[:, 0]
    u = torch.rand((R, k + 1), generator=generator, dtype=torch.float64, device=logits.device)
    if (top_k and top_k < logits.shape[-1]) or top_p < 1.0:
        probs = _sampling_probs(logits, temperature, top_p, top_k)  # [R, k+1, V]
        p_draft = probs[:, :k].gather(-1, drafts[..., None])[..., 0]  # [R, k]
    else:  # no cut: the drafted tokens' probabilities from the normalisers alone, one full distribution a row
        probs = None
        scaled = logits[:, :k].float() / temperature  # [R, k, V]
        p_draft = (scaled.gather(-1, drafts[..., None])[..., 0] - scaled.logsumexp(-1)).exp()  # [R, k]
    kept = (u[:, :k] < p_draft).long().cumprod(-1).sum(-1)  # [R]
    at = probs[rows, kept] if probs is not None else _sampling_probs(logits[rows, kept], temperature, 1.0, 0)
    if k:  # the rejected drafted token removed; with none drafted, a plain step's draw
        rejected = torch.cat([drafts, drafts[:, :1]], dim=-1).gather(-1, kept[:, None])[:, 0]  # [R] (any: all kept)
        at = torch.where((kept < k)[:, None], at.scatter(-1, rejected[:, None], 0.0), at)  # [R, V]
    return kept, _draw(at, u[:, k:])[0]


@torch.no_grad()
def speculative_sample(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    *,
    pad_token_id: int,
    counts: dict[str, int] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """`rollout.sample` with speculation: the same outputs, each step keeping up to `params.speculation.draft_tokens`
    drafted tokens.

    Args:
        params: What to sample with, `params.speculation` the drafts (`Lookup`) and when to draft.
        counts: If given, gets the decode forwards run (`forwards`), the running rows they ran (`row_forwards`),
            the tokens drafted to running rows (`drafted`) and those kept (`kept`).
        The others: as `rollout.sample`.

    Returns:
        `(completion_ids [P*G, C], completion_mask [P*G, C], truncated [P*G], logprobs [P*G, C] or None)`.
    """
    speculation = params.speculation
    if speculation is None:
        raise ValueError("speculative_sample needs params.speculation (its drafts)")
    G, max_new_tokens, stop_ids = params.num_generations, params.max_new_tokens, params.stop_ids
    temperature, top_p, top_k, with_logprobs = params.temperature, params.top_p, params.top_k, params.with_logprobs
    k, max_rows = speculation.draft_tokens, speculation.max_rows
    was_training = model.training
    model.eval()
    try:
        device = prompt_ids.device
        positions = model_positions(model, prompt_ids, prompt_mask)  # [P, Lp]
        # room for the answers twice over: rejected entries stay until `_fit` squeezes them out
        capacity = prompt_ids.shape[1] + 2 * max_new_tokens + 2 * (k + 1)
        cache, _, logits = prefill(model, prompt_ids, prompt_mask, positions, capacity, G)
        n = prompt_ids.shape[0] * G
        stops = torch.as_tensor(list(stop_ids), device=device)
        uniform = None if temperature == 0 else _uniform(n, generator, device)
        first, first_logprob = _pick(logits, temperature, top_p, top_k, uniform, with_logprobs)
        tokens = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        logprobs = torch.zeros(n, max_new_tokens, device=device) if with_logprobs else None
        tokens[:, 0] = first
        if logprobs is not None:
            logprobs[:, 0] = first_logprob
        lengths = torch.ones(n, dtype=torch.long, device=device)  # tokens written per row
        stopped = torch.isin(first, stops)
        attention = prompt_mask.repeat_interleave(G, dim=0)  # [R, L] the cache's mask, one column per entry
        position = positions[:, -1].repeat_interleave(G) + 1  # [R] the position of each row's last token
        last = first  # [R] sampled, not fed yet
        rows = torch.arange(n, device=device)  # the running rows' index in the batch
        sources = [list(s) + [int(stop_ids[0])] for s in speculation.sources for _ in range(G)]
        lookup = Lookup(sources, speculation.ngram, k, pad_token_id)
        answers = [[int(t)] for t in first.tolist()]
        steps = torch.arange(k + 1, device=device)
        while True:
            finished = stopped | (lengths >= max_new_tokens)  # [n] a row's last stop, or its budget spent
            if bool(finished[rows].all()):
                break
            running = (~finished[rows]).nonzero()[:, 0]
            if 2 * running.shape[0] <= rows.shape[0]:  # at least half stopped: run on the others only
                cache.batch_select_indices(running)
                keep = running.tolist()
                rows, attention, position, last = rows[running], attention[running], position[running], last[running]
                lookup.select(keep)
                answers = [answers[i] for i in keep]
            d = k if max_rows is None or rows.shape[0] <= max_rows else 0  # tokens drafted this step
            drafts = torch.tensor(lookup.draft(answers) if d else [[]] * rows.shape[0], dtype=torch.long,
                                  device=device)  # fmt: skip  # [R, d]
            block = steps[: d + 1]
            attention = _fit(cache, attention, d + 1)
            attention = torch.cat([attention, attention.new_ones(attention.shape[0], d + 1)], dim=-1)
            out = model(input_ids=torch.cat([last[:, None], drafts], dim=-1), attention_mask=attention,
                        position_ids=position[:, None] + block, past_key_values=cache, use_cache=True)  # fmt: skip
            logits = out.logits  # [R, d+1, V]
            kept, new = verify(logits, drafts, temperature, top_p, top_k, generator)
            if counts is not None:
                live = ~finished[rows]
                counts["forwards"] = counts.get("forwards", 0) + 1
                counts["row_forwards"] = counts.get("row_forwards", 0) + int(live.sum())
                counts["drafted"] = counts.get("drafted", 0) + d * int(live.sum())
                counts["kept"] = counts.get("kept", 0) + int(kept[live].sum())
            if d:
                attention[:, -d:] = (block[1:] <= kept[:, None]).long()  # a rejected token's entry is masked out
            emitted = torch.cat([drafts, new[:, None]], dim=-1)  # [R, d+1]; the first kept + 1 are written
            emitted.scatter_(-1, kept[:, None], new[:, None])
            count = kept + 1
            at = lengths[rows, None] + block  # [R, d+1] where each would go
            valid = (block < count[:, None]) & (at < max_new_tokens) & ~finished[rows, None]
            is_stop = torch.isin(emitted, stops) & valid
            valid &= (is_stop.long().cumsum(-1) - is_stop.long()) == 0  # nothing after a row's first stop
            r, c = valid.nonzero(as_tuple=True)
            tokens[rows[r], at[r, c]] = emitted[r, c]
            if logprobs is not None:
                scale = 1.0 if temperature == 0 else temperature
                scored = (logits.float() / scale).log_softmax(-1).gather(-1, emitted[..., None])[..., 0]
                logprobs[rows[r], at[r, c]] = scored[r, c]
            lengths[rows] += valid.sum(-1)
            stopped[rows] |= is_stop.any(-1)
            last, position = new, position + count
            for i, (row, m) in enumerate(zip(emitted.tolist(), count.tolist(), strict=True)):
                answers[i].extend(row[:m])
        completion_ids = tokens[:, : int(lengths.max())]
        completion_mask = _mask_through_stop(completion_ids, stops)
        sampled = logprobs[:, : completion_ids.shape[1]] * completion_mask if logprobs is not None else None
        return completion_ids, completion_mask, ~stopped, sampled
    finally:
        model.train(was_training)


def _fit(cache, attention: Tensor, extra: int) -> Tensor:
    """Room for `extra` more entries: when the buffer would overflow, the masked-out entries are squeezed out of the
    cache (`GroupLayer.compact`); the cache's mask [R, L] after."""
    layer = cache.layers[0]
    capacity = getattr(layer, "capacity", None)
    if not hasattr(layer, "compact") or layer.get_seq_length() + extra <= capacity:
        return attention
    keep = attention.bool()
    width = int(keep.sum(-1).max())
    for layer in cache.layers:
        layer.compact(keep, width)
    order = torch.sort((~keep).long(), dim=-1, stable=True).indices[:, :width]  # kept columns first, in order
    return keep.gather(-1, order).long()
