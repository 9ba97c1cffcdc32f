"""Split texts into train / val / test and sample seeded fragment pairs from them."""

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Literal, get_args

from interleave_data.corpus import CorpusError, Text

Split = Literal["train", "val", "test"]
SPLITS: tuple[Split, ...] = get_args(Split)


def interleave(a: Sequence[str], b: Sequence[str]) -> list[str]:
    """Returns ``[a1, b1, a2, b2, ...]``; the tail of the longer sequence follows once the shorter one runs out."""
    merged = [word for pair in zip(a, b, strict=False) for word in pair]
    shorter = min(len(a), len(b))
    return merged + list(a[shorter:]) + list(b[shorter:])


@dataclass(frozen=True)
class Example:
    """One interleaving task.

    Attributes:
        id: Unique within a dataset: ``"<n_words>w-<split>-<index>"``.
        n_words: Words per fragment (the stage length).
        a: Fragment A, words joined by single spaces.
        b: Fragment B, words joined by single spaces.
        target: The expected answer, ``a1 b1 a2 b2 ... aN bN``.
        text_a: Id of the text A was cut from.
        text_b: Id of the text B was cut from.
        split: "train", "val" or "test".
        offset_a: Index of A's first word in its text.
        offset_b: Index of B's first word in its text.
    """

    id: str
    n_words: int
    a: str
    b: str
    target: str
    text_a: str
    text_b: str
    split: str
    offset_a: int
    offset_b: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict) -> "Example":
        """Builds an Example from a row; extra keys are ignored so files may carry more fields.

        Raises:
            CorpusError: A field is missing.
        """
        missing = [f.name for f in fields(cls) if f.name not in row]
        if missing:
            raise CorpusError(f"example is missing field(s) {', '.join(missing)}")
        return cls(**{f.name: row[f.name] for f in fields(cls)})


def split_texts(
    texts: Sequence[Text], fractions: Sequence[float] = (0.8, 0.1, 0.1), seed: int = 0
) -> dict[str, list[Text]]:
    """Assigns each text to one of train / val / test, so held-out pairs come from texts training never saw.

    The split is stratified by length: texts are ranked longest first and each block of ranks is dealt out in the
    given proportions (shuffled within the block), so every split gets its share of the long texts the late stages
    need. The result depends only on the set of texts, the fractions and the seed.

    Args:
        texts: Distinct texts.
        fractions: Shares of train, val and test; non-negative, summing to 1.
        seed: Seeds the shuffles.

    Returns:
        ``{"train": [...], "val": [...], "test": [...]}``, each sorted by text id.

    Raises:
        CorpusError: Bad fractions.
    """
    fractions = check_fractions(fractions)
    ranked = sorted(texts, key=lambda t: (-t.n_words, t.id))
    labels = _balanced_labels(len(ranked), fractions)
    block = max(2, round(1 / min(f for f in fractions if f > 0)))
    rng = random.Random(f"{seed}:split")
    for start in range(0, len(ranked), block):
        chunk = labels[start : start + block]
        rng.shuffle(chunk)
        labels[start : start + block] = chunk
    splits: dict[str, list[Text]] = {name: [] for name in SPLITS}
    for text, label in zip(ranked, labels, strict=True):
        splits[label].append(text)
    return {name: sorted(chunk, key=lambda t: t.id) for name, chunk in splits.items()}


def check_fractions(fractions: Sequence[float]) -> tuple[float, float, float]:
    """Validates split fractions: three non-negative numbers summing to 1, train positive."""
    values = tuple(float(f) for f in fractions)
    if len(values) != 3 or any(f < 0 for f in values) or values[0] <= 0 or not math.isclose(sum(values), 1.0):
        raise CorpusError(f"split fractions must be 3 non-negative numbers summing to 1 (train > 0), got {fractions}")
    return values


def _balanced_labels(n: int, fractions: Sequence[float]) -> list[str]:
    """Deals ``n`` labels so that every prefix holds each split within one of its share."""
    counts = [0] * len(SPLITS)
    labels = []
    for i in range(1, n + 1):
        deficits = [f * i - c for f, c in zip(fractions, counts, strict=True)]
        best = max(range(len(SPLITS)), key=lambda s: deficits[s])
        counts[best] += 1
        labels.append(SPLITS[best])
    return labels


def build_examples(texts: Sequence[Text], n_words: int, n_pairs: int, seed: int, split: str) -> list[Example]:
    """Samples ``n_pairs`` examples with fragments of ``n_words`` words from two different texts each.

    Each pair draws two distinct texts among those with at least ``n_words`` words and a random window in each. The
    random stream is keyed by ``seed``, ``split`` and ``n_words`` only, so a stage's examples do not depend on which
    other stages are built.

    Args:
        texts: The texts of one split.
        n_words: Words per fragment.
        n_pairs: Number of examples.
        seed: Seeds the sampling.
        split: Name of the split, recorded in each example.

    Raises:
        CorpusError: ``n_words`` is not a positive integer, or fewer than two texts are long enough.
    """
    check_length(n_words, "n_words")
    if n_pairs <= 0:
        return []
    usable = [t for t in texts if t.n_words >= n_words]
    if len(usable) < 2:
        raise CorpusError(
            f"stage {n_words} words, split {split!r}: only {len(usable)} of {len(texts)} {split} texts have "
            f">= {n_words} words (need 2); add longer texts, e.g. --corpus pydoc_data.topics more_texts.jsonl"
        )
    rng = random.Random(f"{seed}:{split}:{n_words}")
    return [draw_example(rng, usable, n_words, split, f"{index:05d}") for index in range(n_pairs)]


def draw_example(rng: random.Random, usable: Sequence[Text], n_words: int, split: str, index: str) -> Example:
    """One example: two distinct texts of ``usable`` (each of at least ``n_words`` words), a random window in each.

    ``build_examples`` draws its pools with it; the adaptive curriculum draws training rows at any length with it.
    """
    text_a, text_b = rng.sample(usable, 2)
    offset_a = rng.randrange(text_a.n_words - n_words + 1)
    offset_b = rng.randrange(text_b.n_words - n_words + 1)
    a = text_a.words[offset_a : offset_a + n_words]
    b = text_b.words[offset_b : offset_b + n_words]
    return Example(
        id=f"{n_words}w-{split}-{index}",
        n_words=n_words,
        a=" ".join(a),
        b=" ".join(b),
        target=" ".join(interleave(a, b)),
        text_a=text_a.id,
        text_b=text_b.id,
        split=split,
        offset_a=offset_a,
        offset_b=offset_b,
    )


def build_dataset(
    texts: Sequence[Text],
    lengths: Mapping[str, Sequence[int]],
    pairs: Mapping[str, int],
    fractions: Sequence[float] = (0.8, 0.1, 0.1),
    seed: int = 0,
) -> dict[tuple[int, str], list[Example]]:
    """Splits ``texts`` and builds the examples of every requested stage and split.

    Args:
        texts: The whole corpus.
        lengths: ``split -> stage lengths`` to build for that split.
        pairs: ``split -> examples per stage``.
        fractions: Shares of train, val and test texts.
        seed: Seeds the split and the sampling.

    Returns:
        ``(n_words, split) -> examples``.
    """
    by_split = split_texts(texts, fractions, seed)
    return {
        (n, split): build_examples(by_split[split], n, pairs[split], seed, split)
        for split, split_lengths in lengths.items()
        for n in split_lengths
    }


def usable_counts(texts_by_split: Mapping[str, Sequence[Text]], lengths: Sequence[int]) -> dict[int, dict[str, int]]:
    """``n_words -> split -> number of texts with at least n_words words``."""
    return {n: {split: sum(t.n_words >= n for t in texts) for split, texts in texts_by_split.items()} for n in lengths}


def check_length(value: object, name: str) -> int:
    """Returns ``value`` if it is a positive integer (bools excluded), else raises CorpusError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CorpusError(f"{name} must be a positive integer, got {value!r}")
    return value
