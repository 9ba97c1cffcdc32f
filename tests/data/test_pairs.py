import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from interleave_data.corpus import CorpusError, Text, load_corpus
from interleave_data.pairs import Example, build_dataset, build_examples, interleave, split_texts, usable_counts


def _texts(lengths: list[int]) -> list[Text]:
    return [Text(f"src:{i}", tuple(f"t{i}w{j}" for j in range(n))) for i, n in enumerate(lengths)]


def test_interleave_alternates_words():
    assert interleave(["a1", "a2", "a3"], ["b1", "b2", "b3"]) == ["a1", "b1", "a2", "b2", "a3", "b3"]
    assert interleave([], []) == []


@given(st.lists(st.tuples(st.text(min_size=1), st.text(min_size=1))))
def test_interleave_keeps_each_stream_in_order(pairs):
    a, b = [x for x, _ in pairs], [y for _, y in pairs]

    merged = interleave(a, b)

    assert merged[0::2] == a
    assert merged[1::2] == b


def test_split_is_disjoint_by_text_and_covers_the_corpus():
    texts = load_corpus().texts

    splits = split_texts(texts, (0.8, 0.1, 0.1), seed=3)

    ids = {name: {t.id for t in chunk} for name, chunk in splits.items()}
    assert not ids["train"] & ids["val"] and not ids["train"] & ids["test"] and not ids["val"] & ids["test"]
    assert ids["train"] | ids["val"] | ids["test"] == {t.id for t in texts}
    for name, fraction in zip(("train", "val", "test"), (0.8, 0.1, 0.1), strict=True):
        assert abs(len(ids[name]) - fraction * len(texts)) <= 1


def test_split_is_seeded_and_ignores_input_order():
    texts = load_corpus().texts

    first = split_texts(texts, seed=0)

    assert split_texts(list(reversed(texts)), seed=0) == first
    assert split_texts(texts, seed=1) != first


@pytest.mark.parametrize("seed", range(5))
def test_split_deals_long_texts_to_every_split(seed):
    texts = _texts(list(range(1, 101)))  # distinct lengths: ranking by length is the ranking by index

    splits = split_texts(texts, (0.8, 0.1, 0.1), seed=seed)

    counts = usable_counts(splits, range(1, 101))
    for n in range(1, 101):
        reaching = 101 - n  # texts with at least n words
        for name, fraction in (("val", 0.1), ("test", 0.1)):
            assert math.floor(fraction * reaching) <= counts[n][name] <= math.ceil(fraction * reaching)


@pytest.mark.parametrize("fractions", [(0.5, 0.5), (0.8, 0.3, 0.1), (0.0, 0.5, 0.5), (1.2, -0.1, -0.1)])
def test_bad_fractions_are_refused(fractions):
    with pytest.raises(CorpusError, match="split fractions"):
        split_texts(_texts([3, 3]), fractions)


def test_examples_are_windows_of_two_different_long_enough_texts():
    texts = _texts([5, 30, 40, 50])
    by_id = {t.id: t for t in texts}

    examples = build_examples(texts, n_words=20, n_pairs=50, seed=0, split="val")

    assert len(examples) == 50 and len({e.id for e in examples}) == 50
    for e in examples:
        assert e.text_a != e.text_b
        assert "src:0" not in (e.text_a, e.text_b)  # 5 words: too short for 20
        assert e.a.split() == list(by_id[e.text_a].words[e.offset_a : e.offset_a + 20])
        assert e.b.split() == list(by_id[e.text_b].words[e.offset_b : e.offset_b + 20])
        assert e.target == " ".join(interleave(e.a.split(), e.b.split()))
        assert (e.n_words, e.split) == (20, "val")
    assert len({(e.text_a, e.offset_a) for e in examples}) > 10  # offsets are spread, not fixed


def test_examples_are_deterministic_per_seed():
    texts = load_corpus().texts

    first = build_examples(texts, 25, 20, seed=7, split="train")

    assert build_examples(texts, 25, 20, seed=7, split="train") == first
    assert build_examples(texts, 25, 20, seed=8, split="train") != first
    assert build_examples(texts, 25, 30, seed=7, split="train")[:20] == first  # a longer build extends a shorter one


def test_too_few_long_texts_names_stage_split_counts_and_remedy():
    with pytest.raises(CorpusError) as info:
        build_examples(_texts([10, 600, 20]), n_words=500, n_pairs=4, seed=0, split="test")

    message = str(info.value)
    assert "stage 500 words" in message and "'test'" in message
    assert "only 1 of 3" in message and "--corpus" in message


@pytest.mark.parametrize("n_words", [0, -5, 2.5, "10", True])
def test_stage_length_must_be_a_positive_integer(n_words):
    with pytest.raises(CorpusError, match="n_words must be a positive integer"):
        build_examples(_texts([30, 30]), n_words, 2, seed=0, split="train")


def test_example_dict_round_trip_and_missing_fields():
    example = build_examples(_texts([30, 30]), 10, 1, seed=0, split="train")[0]

    assert Example.from_dict({**example.to_dict(), "extra": 1}) == example
    with pytest.raises(CorpusError, match="missing field.*target"):
        Example.from_dict({k: v for k, v in example.to_dict().items() if k != "target"})


def test_a_stage_does_not_depend_on_the_other_stages_built():
    texts = load_corpus().texts
    pairs = {"train": 5, "val": 3, "test": 3}

    both = build_dataset(texts, {"train": [10, 50]}, pairs, seed=1)
    alone = build_dataset(texts, {"train": [50]}, pairs, seed=1)

    assert both[50, "train"] == alone[50, "train"]
    assert both[10, "train"] != both[50, "train"]
