"""Alignment score: exactness against the plain DP, hand-worked diagnostics, edlib's conventions and limits."""

import random

import edlib
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from interleave_model.evaluation.alignment import (
    Alignment,
    _alignment_runs,
    _bitparallel_runs,
    _edlib_runs,
    _edlib_traces_back,
    _encode,
    align,
    align_batch,
    distance,
    reference_distance,
    score,
    score_batch,
    words,
)

# Fragment A = a1..a4 at even target positions, fragment B = b1..b4 at odd ones.
TARGET = "a1 b1 a2 b2 a3 b3 a4 b4"

SEPARATORS = st.sampled_from([" ", "  ", "\t", "\n", " \n "])
# Letters, marks, numbers, punctuation and symbols from all of Unicode: never whitespace, so one word each.
UNICODE_WORD = st.text(st.characters(exclude_categories=("Z", "C")), min_size=1, max_size=3)
FEW_WORDS = st.sampled_from(["the", "cat", "sat", "on", "mat", "é", "猫", "The", "cat,"])


def _join(draw, word_lists):
    return [draw(SEPARATORS).join(ws) for ws in word_lists]


@st.composite
def text_pairs(draw, vocabulary):
    """Two texts of up to 30 words from a vocabulary, joined by assorted whitespace."""
    pred, target = draw(st.lists(vocabulary, max_size=30)), draw(st.lists(vocabulary, max_size=30))
    return _join(draw, [pred, target])


def _edited(rng: random.Random, target: list[str], rate: float, new_word) -> list[str]:
    """The target with about `rate` of its words substituted, deleted or followed by an inserted word."""
    out = []
    for w in target:
        r = rng.random()
        if r < rate / 3:
            out.append(new_word())
        elif r < 2 * rate / 3:
            continue
        elif r < rate:
            out += [w, new_word()]
        else:
            out.append(w)
    return out


def _check_against_reference(pred: str, target: str) -> None:
    expected = reference_distance(pred, target)
    longest = max(len(pred.split()), len(target.split()))
    assert distance(pred, target) == expected
    assert score(pred, target) == (1.0 - expected / longest if longest else 1.0)
    assert align(pred, target).distance == expected


@settings(max_examples=150, deadline=None)
@given(text_pairs(FEW_WORDS))
def test_distance_matches_reference_on_repeated_words(pair):
    _check_against_reference(*pair)


@settings(max_examples=100, deadline=None)
@given(text_pairs(UNICODE_WORD))
def test_distance_matches_reference_on_unicode(pair):
    _check_against_reference(*pair)


@settings(max_examples=6, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n_target=st.sampled_from([400, 1100]),
    rate=st.sampled_from([0.02, 0.1, 0.5]),
    tail=st.sampled_from([0, 600]),
)
@example(seed=0, n_target=1100, rate=0.1, tail=600)
@example(seed=1, n_target=400, rate=0.02, tail=0)
def test_distance_matches_reference_past_edlib_limit(seed, n_target, rate, tail):
    # Target words drawn with repeats from 2 * n_target ids: about 315 or 870 distinct words, past edlib's 256.
    # Edits bring new words, and a tail of 600 unseen words after the answer takes the vocabulary past 1,000.
    rng = random.Random(seed)
    target = [f"t{rng.randrange(2 * n_target)}" for _ in range(n_target)]
    pred = _edited(rng, target, rate, lambda: f"p{rng.randrange(10**6)}") + [f"x{i}" for i in range(tail)]
    assert len(set(target)) > 256
    assert tail == 0 or n_target < 1000 or len(set(pred) | set(target)) > 1000
    _check_against_reference(" ".join(pred), " ".join(target))


def test_empty_texts():
    assert (score("", ""), distance("", ""), score("a b", ""), score("  ", "a"), distance("", "a b")) == (1, 0, 0, 0, 2)
    both_empty = align("", "")
    assert (both_empty.score, both_empty.first_error, both_empty.a_accuracy, both_empty.b_accuracy) == (1, 0, 1, 1)
    assert both_empty.relative_first_error == 1.0


@settings(max_examples=200, deadline=None)
@given(text_pairs(st.sampled_from(["x", "y", "z"])))
def test_alignment_bookkeeping(pair):
    pred, target = pair
    result = align(pred, target)
    n_pred, n_target = len(pred.split()), len(target.split())
    assert result.substitutions + result.insertions + result.deletions == result.distance
    assert result.insertions - result.deletions == n_pred - n_target
    matched = n_target - result.substitutions - result.deletions
    assert result.a_matched + result.b_matched == matched
    pred_words, target_words = pred.split(), target.split()
    common_prefix = 0
    while common_prefix < min(n_pred, n_target) and pred_words[common_prefix] == target_words[common_prefix]:
        common_prefix += 1
    assert result.first_error == common_prefix


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_python_traceback_breaks_ties_like_edlib(pred, target):
    # A four-word vocabulary makes many optimal alignments; both regimes must pick the same one.
    assert _bitparallel_runs(pred, target) == _edlib_runs(pred, target)


def test_large_inputs_do_not_use_edlibs_hirschberg_path():
    # At 1,900 x 2,000 words edlib switches to Hirschberg, which breaks ties differently here: align must not follow.
    rng = random.Random(0)
    pred = [rng.randrange(2) for _ in range(1900)]
    target = [rng.randrange(2) for _ in range(2000)]
    assert not _edlib_traces_back(len(pred), len(target))
    assert _edlib_runs(pred, target) != _bitparallel_runs(pred, target)
    assert _alignment_runs([str(w) for w in pred], [str(w) for w in target]) == _bitparallel_runs(pred, target)


def test_edlib_cigar_convention():
    # Prediction = query. "I": the query has a word the target lacks; "D": the target has a word the query lacks.
    assert edlib.align(b"abc", b"ac", task="path")["cigar"] == "1=1I1="
    assert edlib.align(b"ac", b"abc", task="path")["cigar"] == "1=1D1="
    assert align("a b c", "a c").insertions == 1 and align("a c", "a b c").deletions == 1


def test_edlib_refuses_more_than_256_symbols_but_encoding_fits():
    pred, target = [f"p{i}" for i in range(300)], [f"t{i}" for i in range(300)]
    with pytest.raises(ValueError):
        edlib.align(pred, target)
    pred_ids, target_ids, n_symbols = _encode(pred, target)
    assert (n_symbols, set(pred_ids), set(target_ids)) == (2, {1}, {0})
    assert distance(" ".join(pred), " ".join(target)) == 300


def _diagnostics(result: Alignment) -> tuple:
    return (
        result.score,
        result.distance,
        result.first_error,
        result.a_accuracy,
        result.b_accuracy,
        result.substitutions,
        result.insertions,
        result.deletions,
    )


def test_skipped_b_word():
    # b2 (target index 3) is missing: one deletion. n_pred = 7, n_target = 8.
    # score = 1 - 1/8 = 0.875; first error at index 3; A 4/4 = 1.0, B 3/4 = 0.75.
    assert _diagnostics(align("a1 b1 a2 a3 b3 a4 b4", TARGET)) == (0.875, 1, 3, 1.0, 0.75, 0, 0, 1)


def test_swapped_streams():
    # Pred b1 a1 b2 a2 b3 a3 b4 a4: no word sits at the same index in both, and a common subsequence takes at most
    # one word of each {a_i, b_i} block, so at most 4 matches. With g insertions and g deletions the substitutions
    # are 8 - g - matches >= 4 - g, so d >= 4 + g; g = 0 matches nothing (d = 8), g = 1 gives d = 5, reached twice:
    #   delete a1, match b1, a1->a2, match b2, a2->a3, match b3, a3->a4, match b4, insert a4   (all of B matched)
    #   insert b1, match a1, b2->b1, match a2, b3->b2, match a3, b4->b3, match a4, delete b4   (all of A matched)
    # Gaps go as late as possible, so the insertion at the end wins: B 4/4, A 0/4.
    # score = 1 - 5/8 = 0.375; the first operation (deleting a1) departs at index 0.
    assert _diagnostics(align("b1 a1 b2 a2 b3 a3 b4 a4", TARGET)) == (0.375, 5, 0, 0.0, 1.0, 3, 1, 1)


def test_truncated_answer():
    # Stops after a3: b3, a4, b4 (indices 5, 6, 7) are deleted. score = 1 - 3/8 = 0.625; first error at 5;
    # A matched a1 a2 a3 = 3/4; B matched b1 b2 = 2/4.
    assert _diagnostics(align("a1 b1 a2 b2 a3", TARGET)) == (0.625, 3, 5, 0.75, 0.5, 0, 0, 3)


def test_extra_words_after_the_answer():
    # The whole target, then 3 extra words: 3 insertions. max(11, 8) = 11, score = 1 - 3/11 = 8/11.
    # Every target word is matched in order, so first_error = n_target = 8 and both streams are 4/4.
    result = align(TARGET + " and so on", TARGET)
    assert _diagnostics(result) == (1 - 3 / 11, 3, 8, 1.0, 1.0, 0, 3, 0)
    assert result.relative_first_error == 1.0


def test_tie_between_repeated_words_keeps_the_match_early():
    # "x" against "x x": matching either target word costs 1; the deletion goes last, so target word 0 (A) is matched.
    assert _diagnostics(align("x", "x x")) == (0.5, 1, 1, 1.0, 0.0, 0, 0, 1)


def test_normalization_is_off_by_default_and_recorded():
    assert words("Hello , World! it's", normalize=True) == ["hello", "", "world", "its"]
    assert align("Hello, World!", "hello world").distance == 2
    normalized = align("Hello, World!", "hello world", normalize=True)
    assert (normalized.distance, normalized.normalized, align("a", "a").normalized) == (0, True, False)
    assert score("ÉTÉ.", "été", normalize=True) == 1.0
    assert distance("a , b", "a b", normalize=True) == reference_distance("a , b", "a b", normalize=True) == 1


def test_batches_match_single_pairs_and_check_lengths():
    preds, targets = ["a1 b1", "b1 a1", ""], ["a1 b1", "a1 b1", "a1"]
    assert score_batch(preds, targets) == [score(p, t) for p, t in zip(preds, targets, strict=True)] == [1.0, 0.0, 0.0]
    assert align_batch(preds, targets) == [align(p, t) for p, t in zip(preds, targets, strict=True)]
    with pytest.raises(ValueError):
        score_batch(["a"], [])
    with pytest.raises(ValueError):
        align_batch([], ["a"])
