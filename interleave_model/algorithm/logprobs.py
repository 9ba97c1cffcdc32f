"""Token log-probs and entropies: chunked kernels over logits or over the LM head.

The kernels never hold an fp32 copy of the whole ``[N, L, V]`` logits, forward or backward; the fused head
(`head_token_logprobs`) never builds the logits at all. Shapes: ``N`` sequences, ``L`` tokens, ``V`` vocabulary.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

# Elements of one fp32 [chunk, V] working tensor: 2**26 floats = 256 MiB, about 520 tokens of Llama-3's 128k vocab.
_CHUNK_ELEMENTS = 2**26
# The fused LM head on a CPU: 4 MiB chunks stay in cache (1.3x faster than 16 MiB, 1.8x than 256 MiB on a small
# vocabulary), but never fewer than 128 token rows: a large vocabulary's head weight is streamed once per chunk, and
# with SmolLM2's 49k-word head 21-row chunks ran its forward and backward 1.6x slower than 128-row ones.
_CPU_CHUNK_ELEMENTS = 2**20
_CPU_MIN_CHUNK_ROWS = 128
# The fused head keeps its forward's fp32 softmax for the backward when it holds at most this many elements (256 MiB):
# a micro-batch of SmolLM2's completions (8 rows, ~600 tokens of a 49k vocabulary, 120 MiB) skips the backward's
# second head matmul, a third of the head's work under LoRA; a long stage's or Llama-3's [T, V] is recomputed.
_KEPT_PROBS_ELEMENTS = 2**26


def _chunks(n: int, length: int, chunk_size: int):
    """Yields (rows, columns) slices tiling an ``[n, length]`` grid with at most ``chunk_size`` cells each."""
    if length <= chunk_size:
        step = chunk_size // max(length, 1)
        for i in range(0, n, step):
            yield slice(i, i + step), slice(None)
    else:
        for i in range(n):
            for j in range(0, length, chunk_size):
                yield slice(i, i + 1), slice(j, j + chunk_size)


def _scaled_chunk(logits: Tensor, rows: slice, cols: slice, temperature: float) -> Tensor:
    """A fresh (safe to modify in place) fp32-or-wider copy of ``logits[rows, cols] / temperature``."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    x = logits[rows, cols].to(dtype, copy=True)  # [n, l, V]
    return x.div_(temperature) if temperature != 1.0 else x


def _chunk_size(logits: Tensor, chunk_size: int | None) -> int:
    if chunk_size is None:
        return max(1, _CHUNK_ELEMENTS // max(logits.shape[-1], 1))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return chunk_size


class _TokenLogProbs(torch.autograd.Function):
    """log softmax(logits / T)[token], chunked both ways: backward keeps only ``logits`` and the ``[N, L]`` lse."""

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float, chunk_size: int) -> Tensor:
        n, length, _ = logits.shape
        out_dtype = torch.promote_types(logits.dtype, torch.float32)
        logprobs = logits.new_empty((n, length), dtype=out_dtype)  # [N, L]
        lse = logits.new_empty((n, length), dtype=out_dtype)  # [N, L]
        for rows, cols in _chunks(n, length, chunk_size):
            x = _scaled_chunk(logits, rows, cols, temperature)  # [n, l, V]
            lse[rows, cols] = torch.logsumexp(x, dim=-1)  # [n, l]
            picked = x.gather(-1, tokens[rows, cols, None]).squeeze(-1)  # [n, l]
            logprobs[rows, cols] = picked - lse[rows, cols]  # [n, l]
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return logprobs

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, tokens, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)  # [N, L, V]
        n, length, _ = logits.shape
        # d/dx_j [x_t / T - lse(x / T)] = (1[j == t] - p_j) / T
        for rows, cols in _chunks(n, length, ctx.chunk_size):
            g = grad_out[rows, cols, None].to(lse.dtype)  # [n, l, 1]
            p = _scaled_chunk(logits, rows, cols, ctx.temperature).sub_(lse[rows, cols, None]).exp_()  # [n, l, V]
            p.mul_(-g).scatter_add_(-1, tokens[rows, cols, None], g)  # [n, l, V]
            grad[rows, cols] = p.div_(ctx.temperature) if ctx.temperature != 1.0 else p
        return grad, None, None, None


def token_logprobs(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, *, chunk_size: int | None = None
) -> Tensor:
    """Log-probability of each token under ``softmax(logits / temperature)``, without a full fp32 log-softmax.

    Works through at most ``chunk_size`` token rows at a time in fp32 (``gather - logsumexp``); the backward pass
    recomputes the softmax chunk by chunk instead of keeping it, so training holds only the logits and an ``[N, L]``
    logsumexp. Logits are divided by ``temperature`` first, as TRL does, so log-probs match the sampling distribution.

    Args:
        logits: ``[N, L, V]`` in any float dtype (non-contiguous views such as ``logits[:, :-1]`` are not copied).
        tokens: ``[N, L]`` token ids, all valid indices into ``V`` (padding positions included).
        temperature: Sampling temperature, > 0.
        chunk_size: Token rows per chunk; default: as many as fit 256 MiB of fp32 ``[chunk, V]``.

    Returns:
        ``[N, L]`` log-probs in float32 (float64 for float64 logits).
    """
    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"expected logits [N, L, V] and tokens [N, L], got {tuple(logits.shape)}, {tuple(tokens.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _TokenLogProbs.apply(logits, tokens.long(), float(temperature), _chunk_size(logits, chunk_size))


@torch.no_grad()
def token_entropy(logits: Tensor, temperature: float = 1.0, *, chunk_size: int | None = None) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` at each position, chunked like :func:`token_logprobs`.

    A diagnostic: computed without grad, so it never enters the loss.

    Args:
        logits: ``[N, L, V]`` in any float dtype.
        temperature: Sampling temperature, > 0.
        chunk_size: Token rows per chunk; default as in :func:`token_logprobs`.

    Returns:
        ``[N, L]`` entropies in nats, float32 (float64 for float64 logits).
    """
    if logits.dim() != 3:
        raise ValueError(f"expected logits [N, L, V], got {tuple(logits.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    n, length, _ = logits.shape
    entropy = logits.new_empty((n, length), dtype=torch.promote_types(logits.dtype, torch.float32))  # [N, L]
    for rows, cols in _chunks(n, length, _chunk_size(logits, chunk_size)):
        x = _scaled_chunk(logits, rows, cols, temperature)  # [n, l, V]
        p = x.sub_(torch.logsumexp(x, dim=-1, keepdim=True)).exp_()  # [n, l, V]
        # xlogy: a -inf logit (masked vocabulary) has p = 0 and contributes 0, not NaN
        entropy[rows, cols] = -torch.special.xlogy(p, p).sum(dim=-1)  # [n, l]
    return entropy


class _HeadTokenLogProbs(torch.autograd.Function):
    """``log softmax(hidden @ weight.T / T)[token]`` (and the entropy) in row chunks, never holding ``[T, V]`` logits.

    The forward keeps ``hidden``, ``weight``, a ``[T]`` logsumexp and, when `keep_probs`, the ``[T, V]`` softmax; the
    backward reads that softmax, or else recomputes each chunk's logits (one more matmul) instead of storing them.
    Both give the same values bit for bit: the same matmul on the same chunk. Matmuls run in ``dtype`` (the autocast
    dtype when it was on), softmax in fp32, with autocast off inside so that forward and backward see the very same
    logits.
    """

    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, chunk_rows, dtype, with_entropy, keep_probs):
        n_tokens, out_dtype = hidden.shape[0], torch.promote_types(dtype, torch.float32)
        logprobs = hidden.new_empty(n_tokens, dtype=out_dtype)  # [T]
        lse = hidden.new_empty(n_tokens, dtype=out_dtype)  # [T]
        entropy = hidden.new_empty(n_tokens if with_entropy else 0, dtype=out_dtype)  # [T] or [0]
        probs = hidden.new_empty((n_tokens, weight.shape[0]) if keep_probs else (0, 0), dtype=out_dtype)  # [T, V]
        w = weight.to(dtype)  # [V, H]
        with _autocast_off(hidden.device.type):
            for start in range(0, n_tokens, chunk_rows):
                rows = slice(start, start + chunk_rows)
                logits = _head_logits(hidden[rows], w, temperature)  # [m, V] fp32 (or wider)
                lse[rows] = torch.logsumexp(logits, dim=-1)
                logprobs[rows] = logits.gather(-1, tokens[rows, None]).squeeze(-1) - lse[rows]
                if not (with_entropy or keep_probs):
                    continue
                p = torch.sub(logits, lse[rows, None], out=probs[rows]) if keep_probs else logits - lse[rows, None]
                p.exp_()  # [m, V]
                if with_entropy:  # H = lse - sum(p * x); a -inf logit has p = 0 and gives 0 * -inf = NaN: skip it
                    product = p * logits if keep_probs else p.mul_(logits)  # the kept softmax is never written
                    entropy[rows] = lse[rows] - product.nansum(-1)
        ctx.save_for_backward(hidden, weight, tokens, lse, probs)
        ctx.temperature, ctx.chunk_rows, ctx.dtype, ctx.keep_probs = temperature, chunk_rows, dtype, keep_probs
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, tokens, lse, probs = ctx.saved_tensors
        w = weight.to(ctx.dtype)  # [V, H]
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None  # [T, H]
        grad_weight = torch.zeros_like(weight, dtype=lse.dtype) if ctx.needs_input_grad[1] else None  # [V, H]
        with _autocast_off(hidden.device.type):
            for start in range(0, hidden.shape[0], ctx.chunk_rows):
                rows = slice(start, start + ctx.chunk_rows)
                g = grad_logprobs[rows, None].to(lse.dtype)  # [m, 1]
                # d/dx_j [x_t / T - lse(x / T)] = (1[j == t] - p_j) / T
                if ctx.keep_probs:
                    p = probs[rows].mul(-g)  # [m, V], a new tensor: the kept softmax stays as it was
                else:
                    p = _head_logits(hidden[rows], w, ctx.temperature).sub_(lse[rows, None]).exp_().mul_(-g)
                grad_logits = p.scatter_add_(-1, tokens[rows, None], g).div_(ctx.temperature)
                grad_logits = grad_logits.to(ctx.dtype)  # [m, V]
                if grad_hidden is not None:
                    grad_hidden[rows] = (grad_logits @ w).to(hidden.dtype)  # [m, H]
                if grad_weight is not None:  # accumulated in fp32 across chunks
                    grad_weight += grad_logits.T @ hidden[rows].to(ctx.dtype)  # [V, H]
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _autocast_off(device: str) -> contextlib.AbstractContextManager:
    return (
        torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else contextlib.nullcontext()
    )


def _head_logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    """``hidden [m, H] @ weight.T / temperature`` in ``weight``'s dtype, returned as fp32-or-wider ``[m, V]``."""
    logits = (hidden.to(weight.dtype) @ weight.T).to(torch.promote_types(weight.dtype, torch.float32))  # [m, V]
    return logits.div_(temperature) if temperature != 1.0 else logits


def head_chunk_rows(vocab_size: int, device: str) -> int:
    """Token rows per chunk of the fused head: 256 MiB of fp32 ``[chunk, V]`` on an accelerator; on a CPU 4 MiB, but
    at least 128 rows."""
    if device != "cpu":
        return max(1, _CHUNK_ELEMENTS // vocab_size)
    return max(_CPU_MIN_CHUNK_ROWS, _CPU_CHUNK_ELEMENTS // vocab_size)


def keeps_probs(n_tokens: int, vocab_size: int) -> bool:
    """Whether the fused head keeps the softmax of `n_tokens` rows for its backward: its ``[T, V]`` within 2**26
    elements."""
    return n_tokens * vocab_size <= _KEPT_PROBS_ELEMENTS


def head_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    chunk_rows: int | None = None,
    keep_probs: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities of ``tokens`` under ``softmax(hidden @ weight.T / temperature)``, without the logits tensor.

    The LM head and :func:`token_logprobs` fused: for ``T`` tokens and a vocabulary of ``V``, a training step holds
    neither the ``[T, V]`` logits nor their gradient, only one ``[chunk_rows, V]`` chunk at a time (the backward
    recomputes it). This is where a long-completion, large-vocabulary step's memory went (Llama-3 at 16 x 1,000
    completion tokens: 8 GiB of fp32 logits and 8 more of gradient). Under autocast the matmuls run in the autocast
    dtype, as the model's own LM head would; softmax and outputs are fp32.

    Args:
        hidden: ``[T, H]`` final hidden states (after the model's last norm), one per scored token.
        weight: ``[V, H]`` LM-head weight (no bias).
        tokens: ``[T]`` token ids to score.
        temperature: Sampling temperature, > 0; logits are divided by it, as in :func:`token_logprobs`.
        with_entropy: Also return the entropy of each position's distribution (a detached diagnostic).
        chunk_rows: Tokens per chunk; default `head_chunk_rows`.
        keep_probs: Keep the forward's ``[T, V]`` softmax for the backward instead of recomputing its logits there;
            default: when a gradient is wanted and it holds at most ``2**26`` elements (`keeps_probs`).

    Returns:
        ``([T] log-probs, [T] entropies or None)``, fp32 (float64 for float64 inputs).
    """
    if hidden.dim() != 2 or tokens.shape != hidden.shape[:1] or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"expected hidden [T, H], weight [V, H], tokens [T]; got {tuple(hidden.shape)}, {tuple(weight.shape)}, "
            f"{tuple(tokens.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_rows is None:
        chunk_rows = head_chunk_rows(weight.shape[0], hidden.device.type)
    device = hidden.device.type
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else torch.promote_types(hidden.dtype, weight.dtype)
    if keep_probs is None:
        wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        keep_probs = wants_grad and keeps_probs(hidden.shape[0], weight.shape[0])
    logprobs, entropy = _HeadTokenLogProbs.apply(
        hidden, weight, tokens.long(), float(temperature), chunk_rows, dtype, with_entropy, keep_probs
    )
    return logprobs, (entropy if with_entropy else None)
