"""The longest prompt and target of a set of examples in tokens, counted exactly as `collate` tokenizes them.

Every example is counted: the longest in characters is not always the longest in tokens. Only lengths are needed, so
nothing is padded or turned into tensors or Python lists of ids: the texts go through the tokenizer's Rust backend,
a chunk at a time, by `encode_batch_fast` (no character offsets). That is the pipeline `tokenizer(texts)` runs, minus
the padding and truncation an earlier call may have left set on it.

A length's two numbers are kept beside the Arrow cache (`<cache root>/token_counts/<key>.json`), the key a hash of
everything they depend on: the `tokenizers` version, the tokenizer's whole pipeline and `split_special_tokens`,
whether prompts get its special tokens, and every prompt text (chat template applied) and target text. A second run
of a config formats and hashes its texts and tokenizes nothing (docs/ARCHITECTURE.md has what each costs).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

import tokenizers
from tokenizers import Tokenizer

from interleave_data.atomic import replacing
from interleave_data.cache import cache_root
from interleave_data.prompts import adds_special_tokens, format_prompt

CHUNK = 1024  # texts tokenized at once: a chunk's encodings are held, not a whole length's
FORMAT_VERSION = 1  # bump when what is counted changes, so counts written by older code are not read


class Longest(NamedTuple):
    """The most tokens one example's prompt has (chat template and special tokens included), and one target has."""

    prompt: int
    target: int


def longest(datamodule, examples: Mapping[int, Sequence]) -> dict[int, Longest]:
    """The longest prompt and target of each length's examples in tokens, as `datamodule.collate` tokenizes them.

    A length's two numbers are read from the cache under `datamodule.cache_dir` when its texts were counted with
    this tokenizer before, else counted and written there (not for a tokenizer without a Rust pipeline, whose state
    has no fingerprint here). The tokenizer's state is read once for all lengths.

    Args:
        datamodule: An `InterleaveDataModule` with its tokenizer (its template formats the prompts).
        examples: `n_words -> examples`, at least one example each.
    """
    tokenizer = datamodule.tokenizer
    special, state = adds_special_tokens(tokenizer), pipeline(tokenizer)
    backend = None if state is None else _backend(tokenizer, state)
    folder = cache_root(datamodule.cache_dir) / "token_counts"
    counts = {}
    for n_words, pool in examples.items():
        prompts = [format_prompt(e.a, e.b, datamodule.template, tokenizer) for e in pool]
        targets = [e.target for e in pool]
        if state is None:  # no fingerprint of the tokenizer: counted at every run
            counts[n_words] = _count(tokenizer, None, prompts, targets, special)
            continue
        path = folder / f"{_key(tokenizer, state, special, prompts, targets)}.json"
        if not path.exists():
            with replacing(path, concurrent=True) as tmp:  # every DDP rank counts on a first run, and writes the same
                tmp.write_text(json.dumps(_count(tokenizer, backend, prompts, targets, special)._asdict()))
        counts[n_words] = Longest(**json.loads(path.read_text()))
    return counts


def _count(tokenizer, backend: Tokenizer | None, prompts: list[str], targets: list[str], special: bool) -> Longest:
    prompt = max(lengths(tokenizer, backend, prompts, special))
    return Longest(prompt, max(lengths(tokenizer, backend, targets, False)))


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


def _key(tokenizer, state: str, special: bool, prompts: list[str], targets: list[str]) -> str:
    """A hash of everything the counts depend on. Each text list's lengths go in first, so no two lists of texts
    hash alike by moving characters from one text to the next."""
    split = bool(getattr(tokenizer, "split_special_tokens", False))
    header = [FORMAT_VERSION, tokenizers.__version__, state, split, special]  # the library's own fixes included
    digest = hashlib.sha256(json.dumps(header).encode())
    for texts in (prompts, targets):
        digest.update(array("q", map(len, texts)).tobytes())
        for text in texts:
            digest.update(text.encode())
    return digest.hexdigest()[:32]
