"""The longest prompt and target of a set of examples in tokens, counted exactly as `collate` tokenizes them.

Every example is counted: the longest in characters is not always the longest in tokens. Only lengths are needed, so
nothing is padded or turned into tensors or Python lists of ids: the texts go through the tokenizer's Rust backend,
a chunk at a time, by `encode_batch_fast` (no character offsets). That is the pipeline `tokenizer(texts)` runs, minus
the padding and truncation an earlier call may have left set on it (docs/ARCHITECTURE.md has what this costs).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from tokenizers import Tokenizer

from interleave_data.prompts import adds_special_tokens, format_prompt

CHUNK = 1024  # texts tokenized at once: a chunk's encodings are held, not a whole length's


class Longest(NamedTuple):
    """The most tokens one example's prompt has (chat template and special tokens included), and one target has."""

    prompt: int
    target: int


def longest(datamodule, examples: Sequence) -> Longest:
    """The longest prompt and target of `examples` in tokens, as `datamodule.collate` tokenizes them, without padding.

    Args:
        datamodule: An `InterleaveDataModule` with its tokenizer (its template formats the prompts).
        examples: At least one example.
    """
    tokenizer = datamodule.tokenizer
    prompts = [format_prompt(e.a, e.b, datamodule.template, tokenizer) for e in examples]
    state = pipeline(tokenizer)
    backend = None if state is None else _backend(tokenizer, state)
    prompt = max(lengths(tokenizer, backend, prompts, adds_special_tokens(tokenizer)))
    return Longest(prompt, max(lengths(tokenizer, backend, [e.target for e in examples], False)))


def lengths(tokenizer, backend: Tokenizer | None, texts: Sequence[str], special: bool) -> Iterator[int]:
    """Each text's number of token ids, as `tokenizer(texts, add_special_tokens=special)` gives them.

    `backend` is `_backend`'s copy of the tokenizer's Rust pipeline; None for a tokenizer without one (a slow one),
    which is then called itself.
    """
    for start in range(0, len(texts), CHUNK):
        chunk = texts[start : start + CHUNK]
        if backend is None:
            yield from map(len, tokenizer(chunk, add_special_tokens=special)["input_ids"])
        else:
            yield from map(len, backend.encode_batch_fast(chunk, add_special_tokens=special))


def pipeline(tokenizer) -> str | None:
    """The tokenizer's Rust pipeline as JSON (normalizer, pre-tokenizer, model, post-processor, added tokens), without
    the padding and truncation a call leaves set on it; None for a tokenizer without a Rust backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    state = json.loads(backend.to_str())
    state.update(padding=None, truncation=None)
    return json.dumps(state, sort_keys=True)


def _backend(tokenizer, state: str) -> Tokenizer:
    """A copy of the tokenizer's Rust pipeline to count with: no padding, no truncation, whatever the shared one has."""
    backend = Tokenizer.from_str(state)
    # transformers sets this from `split_special_tokens` at every call (special-token text split as plain text)
    backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    return backend
