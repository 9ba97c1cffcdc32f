"""Arrow cache of built examples (HF ``datasets``), keyed by the corpus content and every parameter of the build.

The key hashes the bytes of the corpus sources, so editing a corpus file moves the cache to a new folder: a stale
build is never served. (``Dataset.from_generator`` would key its cache by the generator, not by the file content.)
"""

import hashlib
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import datasets

from interleave_data.atomic import replacing_dir
from interleave_data.corpus import corpus_fingerprint, load_corpus
from interleave_data.pairs import Example, build_dataset

# Bump when sampling changes, so caches built by older code are not reused.
FORMAT_VERSION = 1

FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "n_words": datasets.Value("int64"),
        "a": datasets.Value("string"),
        "b": datasets.Value("string"),
        "target": datasets.Value("string"),
        "text_a": datasets.Value("string"),
        "text_b": datasets.Value("string"),
        "split": datasets.Value("string"),
        "offset_a": datasets.Value("int64"),
        "offset_b": datasets.Value("int64"),
    }
)


def cache_path(
    sources: Sequence[str] | None,
    lengths: Mapping[str, Sequence[int]],
    pairs: Mapping[str, int],
    fractions: Sequence[float],
    seed: int,
    cache_dir: str | None = None,
) -> Path:
    """The cache folder for one build; its name is a hash of the corpus content and the build parameters."""
    key = {
        "version": FORMAT_VERSION,
        "corpus": corpus_fingerprint(sources),
        "lengths": {split: list(ns) for split, ns in lengths.items()},
        "pairs": dict(pairs),
        "fractions": [float(f) for f in fractions],
        "seed": seed,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return cache_root(cache_dir) / digest[:24]


def cache_root(cache_dir: str | None = None) -> Path:
    """The folder of every build (and of the preflight's token counts); `cache_dir` None means the HF datasets cache."""
    return (Path(cache_dir) if cache_dir else Path(datasets.config.HF_DATASETS_CACHE)) / "interleave_data"


def build_cache(
    path: Path,
    sources: Sequence[str] | None,
    lengths: Mapping[str, Sequence[int]],
    pairs: Mapping[str, int],
    fractions: Sequence[float],
    seed: int,
) -> None:
    """Builds the examples and saves them at ``path`` unless already there; a partial build is never visible.

    The build must hold at least one example: ``datasets`` cannot read back an empty saved dataset.

    Raises:
        CorpusError: Bad corpus or too few long texts; nothing is written.
    """
    if path.exists():
        return
    examples = build_dataset(load_corpus(sources).texts, lengths, pairs, fractions, seed)
    rows = [example.to_dict() for key in examples for example in examples[key]]
    dataset = datasets.Dataset.from_dict({name: [row[name] for row in rows] for name in FEATURES}, features=FEATURES)
    with replacing_dir(path, concurrent=True) as staging, _progress_bars():
        dataset.save_to_disk(str(staging))


def load_cache(path: Path) -> dict[tuple[int, str], list[Example]]:
    """Reads a cache folder back as ``(n_words, split) -> examples``, in build order."""
    pools: dict[tuple[int, str], list[Example]] = {}
    with _progress_bars():
        rows = datasets.load_from_disk(str(path)).to_list()
    for row in rows:
        example = Example.from_dict(row)
        pools.setdefault((example.n_words, example.split), []).append(example)
    return pools


@contextmanager
def _progress_bars() -> Iterator[None]:
    """Hide `datasets`' progress bars unless this module logs at INFO (`LOGLEVEL=INFO`, run/console.py).

    A build takes about a second; its bars would otherwise fill the console of every run.
    """
    if logging.getLogger(__name__).isEnabledFor(logging.INFO) or not datasets.is_progress_bar_enabled():
        yield
        return
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.enable_progress_bars()
