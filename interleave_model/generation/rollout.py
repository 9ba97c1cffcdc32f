"""Grouped sampling: P prompts x G completions, each prompt prefilled once and its KV cache shared by its group."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from interleave_model.generation.decode_step import decode_step
from interleave_model.generation.merged_copy import GROUPED_DECODE
from interleave_model.generation.rollout_cache import rollout_cache
from interleave_model.generation.sampling_params import SamplingParams
from interleave_model.model.positions import model_positions

_BLOCK = 256  # tokens per block of the sampler's two-level CDF
_CHECK_EVERY = 8  # decode steps between two looks at which rows have stopped


class Rollout(NamedTuple):
    """The completions of one batch, group-major: rows g*G .. g*G+G-1 answer prompt g."""

    prompt_ids: Tensor  # [P*G, Lp] left-padded
    prompt_mask: Tensor  # [P*G, Lp] 1 = real token
    completion_ids: Tensor  # [P*G, C] right-padded with pad after the first stop token
    completion_mask: Tensor  # [P*G, C] 1 = generated token up to and including the first stop token
    truncated: Tensor  # [P*G] bool: the budget ran out before a stop token
    texts: list[str]  # the decoded tokens before the first stop token (see `completion_texts`)
    logprobs: Tensor | None = None  # [P*G, C] the sampling engine's log-probs of its tokens (vLLM, a merged copy)


def token_budget(target_lengths: Sequence[int], margin: float = 0.25, slack: int = 4) -> int:
    """New tokens to allow for a batch: the longest target's token count plus a margin, plus EOS and some slack.

    The budget follows the batch, so a 10-word stage never pays for a 500-word budget and no stage truncates a
    correct answer (the longest target fits with `margin` to spare).
    """
    return math.ceil(max(target_lengths) * (1.0 + margin)) + 1 + slack


# Evaluation's budget allows this many tokens for each word of the answer. Byte-level BPEs spend about 1.5 on the
# default corpus, and at most 2.3 on any 10-word test pair (SmolLM2's tokenizer); a word-level tokenizer spends 1.
# (`Sampler.eval_budget` gives a finer tokenizer more, from its targets.)
ANSWER_TOKENS_PER_WORD = 3
ANSWER_SLACK = 8  # the stop token, and room to spare


def answer_budget(n_words: int) -> int:
    """New tokens a held-out answer to fragments of `n_words` words may take: 3 per answer word, plus 8.

    A function of the length alone, not of the batch or the tokenizer, so that a greedy answer that never stops is cut
    at the same point in every batch and by every evaluator (the lm-eval tasks' `max_gen_toks` are these values).
    """
    return ANSWER_TOKENS_PER_WORD * 2 * n_words + ANSWER_SLACK


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    *,
    pad_token_id: int,
    check_every: int = _CHECK_EVERY,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Sample `params.num_generations` completions per prompt; temperature 0 means greedy.

    The decode loop reads nothing back from the device between checks: every `check_every` steps it looks whether
    all rows have stopped (a row's tokens after its stop are pad whenever it is looked at, so the output is the same
    as with a look at every step), and when at least half of the running rows have stopped it retires them (their
    cache rows, mask and positions are dropped, and the model runs on the others). Retiring keeps sampled output the
    same too: one uniform number is still drawn for every row of the batch at every step, each row using its own.

    Args:
        model: A causal LM taking `input_ids, attention_mask, position_ids, past_key_values, use_cache`.
        prompt_ids: Left-padded prompts, [P, Lp].
        prompt_mask: 1 for real prompt tokens, [P, Lp].
        params: What to sample with (`params.speculation` is not read: `speculative.speculative_sample` reads it).
        generator: The stream of the sampled draws.
        pad_token_id: Written after a row's stop token.
        check_every: Decode steps between two looks at which rows have stopped (each look is one host sync).

    Returns:
        `(completion_ids [P*G, C], completion_mask [P*G, C], truncated [P*G], logprobs [P*G, C] or None)`,
        C <= max_new_tokens; the log-probs with `params.with_logprobs`, 0 after a row's stop.
    """
    was_training = model.training
    model.eval()  # dropout off while sampling, so the rollout is drawn from the policy being scored
    try:
        G, max_new_tokens, temperature = params.num_generations, params.max_new_tokens, params.temperature
        top_p, top_k, with_logprobs = params.top_p, params.top_k, params.with_logprobs
        positions = model_positions(model, prompt_ids, prompt_mask)  # [P, Lp]
        prompt_length = prompt_ids.shape[1]
        # the grouped-decode attention reads each prompt's keys once for its group (`SharedPrefix`)
        shared = _attention_implementation(model) == GROUPED_DECODE
        cache, grouped, logits = prefill(
            model, prompt_ids, prompt_mask, positions, prompt_length + max_new_tokens, G, shared
        )
        n = logits.shape[0]
        # one mask for the whole rollout, each step passes a longer view of it (no per-step concatenation)
        attention = prompt_mask.new_ones(n, prompt_length + max_new_tokens)  # [P*G, Lp+max_new_tokens]
        attention[:, :prompt_length] = prompt_mask.repeat_interleave(G, dim=0)
        if grouped:  # plain full-attention layers: a sliding window would be lost in a 4-D mask passed as is
            attention = _decode_mask(model, attention, padded=not bool(prompt_mask.all()))
        position = positions[:, -1:].repeat_interleave(G, dim=0)  # [R, 1]
        rows = torch.arange(n, device=logits.device)  # [R] the running rows' index in the batch
        finished = torch.zeros(n, dtype=torch.bool, device=logits.device)  # [P*G]
        stops = torch.as_tensor(list(params.stop_ids), device=logits.device)  # [S]
        pad = torch.full((n,), pad_token_id, dtype=torch.long, device=logits.device)  # [P*G]
        step_logits = decode_step(model)  # a plain Llama's step without transformers' module stack, same logits
        tokens: list[Tensor] = []
        logprobs: list[Tensor] = []
        for step in range(max_new_tokens):
            # one number per row of the batch, whatever rows are retired, so each row draws the same numbers
            uniform = None if temperature == 0 else _uniform(n, generator, logits.device)[rows]  # [R, 1]
            picked, picked_logprobs = _pick(logits, temperature, top_p, top_k, uniform, with_logprobs)  # [R] each
            token = torch.where(finished, pad, pad.index_put((rows,), picked))  # [P*G]
            tokens.append(token)
            if with_logprobs:
                logprobs.append(torch.zeros(n, device=logits.device).index_put((rows,), picked_logprobs))
            finished |= torch.isin(token, stops)
            if step == max_new_tokens - 1:  # no forward whose logits nobody reads
                break
            if (step + 1) % check_every == 0:
                running = (~finished[rows]).nonzero()[:, 0]  # [R'] the one host sync of `check_every` steps
                if running.shape[0] == 0:
                    break
                if 2 * running.shape[0] <= rows.shape[0]:  # at least half stopped: run on the others only
                    cache.batch_select_indices(running)
                    rows, position = rows[running], position[running]
                    attention = attention[running] if attention is not None else None
            position = position + 1
            mask = attention[..., : prompt_length + step + 1] if attention is not None else None
            logits = step_logits(token[rows, None], mask, position, cache)  # [R, V]
        completion_ids = torch.stack(tokens, dim=1)  # [P*G, C]
        completion_mask = _mask_through_stop(completion_ids, stops)  # [P*G, C]
        sampled_logprobs = torch.stack(logprobs, dim=1) * completion_mask if with_logprobs else None  # [P*G, C]
        if finished.all():  # the steps the checks let run after the last stop are all pad: drop them
            completion_ids = completion_ids[:, : int(completion_mask.sum(-1).max())]
            completion_mask = completion_mask[:, : completion_ids.shape[1]]
            if sampled_logprobs is not None:
                sampled_logprobs = sampled_logprobs[:, : completion_ids.shape[1]]
        return completion_ids, completion_mask, ~finished, sampled_logprobs
    finally:
        model.train(was_training)


def prefill(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    positions: Tensor,
    capacity: int,
    group: int,
    shared: bool = False,
):
    """The prompts' forward at `positions` (the caller's `model_positions`, [P, Lp]) into a rollout cache of `capacity`
    positions for `group` rows each (`rollout_cache`).

    Returns:
        `(cache, grouped, logits)`: the cache, whether its layers hold the whole group, and the next-token logits of
        each of the P*G rows [P*G, V] (a prompt's repeated for its group).
    """
    length = prompt_ids.shape[1]
    cache, grouped = rollout_cache(model, capacity=capacity, group=group, shared=shared)
    out = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        # the last position by index, not `logits_to_keep=1`: its slice of the hidden states is not contiguous,
        # so the head's linear would copy its weight once per prompt (a [P, H, V] copy on a CPU)
        logits_to_keep=torch.tensor([length - 1], device=prompt_ids.device),
    )
    if group > 1 and not grouped:
        cache.batch_repeat_interleave(group)
    return cache, grouped, out.logits[:, -1].repeat_interleave(group, dim=0)


def _decode_mask(model: torch.nn.Module, attention: Tensor, padded: bool) -> Tensor | None:
    """What a decode step passes as `attention_mask`, sliced to the step's length on its last dimension.

    Given a 2-D mask, transformers' mask creation checks at every step whether it holds any padding (a host sync).
    A 4-D mask is passed through unchecked, so SDPA and eager attention get the 4-D mask they would build from
    `attention` [N, L] for one query, [N, 1, 1, L] (boolean for SDPA, additive for eager). A batch without padding
    gets none, as transformers would find itself. Other attention implementations get the 2-D mask (and check it).
    """
    if not padded:
        return None
    implementation = _attention_implementation(model)
    if implementation in ("sdpa", GROUPED_DECODE):
        return attention.bool()[:, None, None, :]
    if implementation == "eager":
        dtype = model.get_input_embeddings().weight.dtype  # transformers' choice: the dtype of the embeddings
        additive = torch.zeros(attention.shape, dtype=dtype, device=attention.device)
        return additive.masked_fill_(attention == 0, torch.finfo(dtype).min)[:, None, None, :]
    return attention


def _attention_implementation(model: torch.nn.Module) -> str | None:
    """The attention implementation the model runs under (`config._attn_implementation`), None without a config."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def _uniform(n: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """One uniform number in [0, 1) per row, [n, 1] float64: the randomness of one sampling step."""
    return torch.rand((n, 1), generator=generator, dtype=torch.float64, device=device)


def rollout(
    model: torch.nn.Module,
    tokenizer,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    draw: Callable[..., tuple] = sample,
) -> Rollout:
    """`draw` (`sample`, or `speculative.speculative_sample`, which takes the same arguments) plus the bookkeeping the
    loss needs: repeated prompts and decoded texts."""
    G = params.num_generations
    completion_ids, completion_mask, truncated, logprobs = draw(
        model, prompt_ids, prompt_mask, params, generator, pad_token_id=tokenizer.pad_token_id
    )
    return Rollout(
        prompt_ids=prompt_ids.repeat_interleave(G, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(G, dim=0),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        truncated=truncated,
        texts=completion_texts(tokenizer, completion_ids, params.stop_ids),
        logprobs=logprobs,
    )


def completion_texts(tokenizer, completion_ids: Tensor, stop_ids: Sequence[int]) -> list[str]:
    """The text of each completion: its tokens before its first stop token, decoded, whitespace runs made one space.

    Nothing after the stop token is decoded (padding there may be a real token: `!` is id 0 in Llama-3). Other
    special tokens the model wrote inside its answer are kept, as the text a reader of the answer sees: the reward
    counts `<|start_header_id|>` or a glued `word<|begin_of_text|>` as the wrong word it is, instead of scoring a
    cleaned answer the model never wrote.
    """
    is_stop = torch.isin(completion_ids, torch.as_tensor(list(stop_ids), device=completion_ids.device))  # [N, C]
    lengths = (is_stop.long().cumsum(-1) == 0).sum(-1).tolist()  # [N] tokens before the first stop
    return [decode(tokenizer, ids[:n]) for ids, n in zip(completion_ids.tolist(), lengths, strict=True)]


def decode(tokenizer, ids: Sequence[int]) -> str:
    """Token ids as the reward reads them: special tokens kept, no clean-up of spaces before punctuation.

    `clean_up_tokenization_spaces` (on in many tokenizer_config.json files; transformers 5 skips it for BPE only) would
    turn the words `word .` into `word.`, another word than the model wrote. The preflight's round-trip check decodes
    the targets through this too.
    """
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return " ".join(text.split())


def _pick(
    logits: Tensor, temperature: float, top_p: float, top_k: int, uniform: Tensor | None, with_logprobs: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Next token per row from `logits` [N, V]: argmax at temperature 0, else a sample after top-k / top-p drawn with
    the row's number of `uniform` [N, 1] (in [0, 1)). `logits` may be overwritten: the caller reads them no more.

    With `with_logprobs`, also each token's log-prob as the trainer scores it, log_softmax(logits / temperature)
    before top-k / top-p (temperature 0: of the logits). Without top-k / top-p it comes from the sampling weights
    themselves, log(weight of the token / total weight), so no second pass over the vocabulary is made for it.
    """
    if temperature == 0:
        picked = logits.argmax(-1)
        return picked, _logprobs_of(logits, picked, 1.0) if with_logprobs else None
    cut = bool(top_k and top_k < logits.shape[-1]) or top_p < 1.0
    full = _logprobs_of(logits, None, temperature) if with_logprobs and cut else None  # [N, V], before the cuts
    # float32 in place: a fresh [N, V] float32 buffer per operation costs more than the operation on a CPU
    logits = logits.float()  # [N, V]; the caller's own tensor when it is float32 already
    if temperature != 1.0:
        logits.div_(temperature)
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [N, 1]
        logits.masked_fill_(logits < kth, -math.inf)
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass (the first always stays)
        drop = (probs.cumsum(-1) - probs) > top_p
        logits.scatter_(-1, order, sorted_logits.masked_fill(drop, -math.inf))
    # unnormalised probabilities are enough: _draw scales its uniform number by their total
    weights = logits.sub_(logits.amax(-1, keepdim=True)).exp_()  # [N, V]
    picked, total = _draw(weights, uniform)  # [N], [N] float64
    if not with_logprobs:
        return picked, None
    if full is not None:
        return picked, full.gather(-1, picked[:, None])[:, 0]
    return picked, (weights.gather(-1, picked[:, None])[:, 0].double().log() - total.log()).float()


def _logprobs_of(logits: Tensor, picked: Tensor | None, temperature: float) -> Tensor:
    """log_softmax(logits / temperature) [N, V] in float32, or its entries at `picked` [N] when given."""
    scaled = (logits.float() / temperature).log_softmax(-1)  # [N, V]
    return scaled if picked is None else scaled.gather(-1, picked[:, None])[:, 0]


def _draw(weights: Tensor, uniform: Tensor) -> tuple[Tensor, Tensor]:
    """One token per row, with probability proportional to `weights` [N, V] (>= 0), by inverting the CDF; and each
    row's total weight [N] (float64).

    `torch.multinomial` draws an exponential number for every vocabulary entry, which made it the largest single cost
    of a CPU rollout (about 10x this). Here one uniform number per row picks a block of `_BLOCK` tokens on the float64
    CDF of the block sums, then a token on that block's own float64 CDF. Rounding can shift a block's mass by about
    1e-7 of itself, never a fixed amount, so the rare tail of a 128k vocabulary keeps its probabilities (a float32 CDF
    over the whole vocabulary would round every tail token to a multiple of 6e-8). The number stays strictly below
    each total, so a token of zero weight (cut by top-k or top-p) is never drawn. The numbers are `uniform` [N, 1]
    (in [0, 1)), one per row.
    """
    n, vocab = weights.shape
    full = vocab - vocab % _BLOCK
    sums = weights[:, :full].reshape(n, -1, _BLOCK).sum(-1)  # [N, K]
    if full < vocab:
        sums = torch.cat([sums, weights[:, full:].sum(-1, keepdim=True)], dim=-1)  # the last, partial block
    block_cdf = sums.double().cumsum(-1)  # [N, K]
    total = block_cdf[:, -1:]  # [N, 1]
    u = uniform * total  # [N, 1]
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(u)))
    block = torch.searchsorted(block_cdf, u, right=True)  # [N, 1], the first block whose CDF exceeds u
    before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0)), 0.0)  # [N, 1]
    columns = block * _BLOCK + torch.arange(_BLOCK, device=weights.device)  # [N, B]
    inside = weights.gather(-1, columns.clamp(max=vocab - 1)).masked_fill(columns >= vocab, 0.0)  # [N, B]
    within = inside.double().cumsum(-1)  # [N, B]
    rest = torch.minimum(u - before, torch.nextafter(within[:, -1:], torch.zeros_like(u)))  # [N, 1]
    return block[:, 0] * _BLOCK + torch.searchsorted(within, rest, right=True)[:, 0], total[:, 0]


def _mask_through_stop(completion_ids: Tensor, stops: Tensor) -> Tensor:
    """1 for every token up to and including the first stop token of its row, 0 after it. [N, C] -> [N, C] long."""
    is_stop = torch.isin(completion_ids, stops).long()  # [N, C]
    stops_before = is_stop.cumsum(-1) - is_stop  # stop tokens strictly before each position
    return (stops_before == 0).long()
