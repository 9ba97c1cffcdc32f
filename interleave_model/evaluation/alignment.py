"""Word-level alignment of a prediction against its target: score, edit distance and where the streams were lost.

Words are whitespace tokens (`str.split()`). The score is ``1 - d / max(len(pred_words), len(target_words))``
with ``d`` the unit-cost Levenshtein distance over words; 1.0 when both are empty, 0.0 when exactly one is.

Exact for any vocabulary. Words are mapped to small integers by `_encode`: each word present in both sequences
gets its own symbol and every other word collapses to one symbol per side. A word present in one sequence only
can never be matched, so every alignment keeps its cost and the distance (and every optimal path) is unchanged.

- `distance` / `score`: rapidfuzz's bit-parallel Levenshtein over the integer ids, whatever the vocabulary size.
- `align`: edlib's alignment path when the symbols fit its 256-value limit (and edlib traces back rather than
  switching to Hirschberg, see `_edlib_traces_back`); otherwise `_bitparallel_runs`, the same bit-parallel
  algorithm in Python integers with the same traceback, so both give the same alignment.

Ties between optimal alignments are broken the way edlib's traceback breaks them: walking back from the last
words, an extra prediction word (insertion) is taken when it stays optimal, else a missing target word
(deletion), else the diagonal (match or substitution). Gaps therefore sit as late as possible, and the chosen
alignment always matches the whole common word prefix of prediction and target, so `first_error` is its length
(a property the tests check).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

import edlib
from rapidfuzz.distance import Levenshtein

# edlib's Python binding refuses inputs with more distinct values than this.
EDLIB_MAX_SYMBOLS = 256
# edlib traces back through the full matrix only below 1 MiB of alignment data, else it runs Hirschberg, whose
# split points break ties differently (edlib.cpp, obtainAlignment).
_EDLIB_TRACEBACK_BYTES = 1 << 20
_CIGAR = re.compile(r"(\d+)([=XID])")
_RUNS = re.compile(r"=+|X+|I+|D+")
_NOT_WORD_CHAR = re.compile(r"[^\w]")


@dataclass(frozen=True)
class Alignment:
    """Diagnostics of one optimal word alignment of a prediction against its target.

    Target words at even positions (0, 2, ...) come from fragment A, odd positions from fragment B.

    Attributes:
        score: ``1 - distance / max(n_pred, n_target)``; 1.0 when both are empty.
        distance: Word-level edit distance (``substitutions + insertions + deletions``).
        n_pred: Words in the prediction.
        n_target: Words in the target.
        first_error: Index into the target words of the first operation that is not a match (for an insertion,
            the index of the target word it precedes); ``n_target`` when every target word is matched in order,
            extra words after the answer included. Equals the length of the common word prefix.
        a_matched: Fragment-A target words the alignment matches.
        b_matched: Fragment-B target words the alignment matches.
        a_accuracy: ``a_matched`` over the fragment-A target words; 1.0 when there are none.
        b_accuracy: ``b_matched`` over the fragment-B target words; 1.0 when there are none.
        substitutions: Target words replaced by another word.
        insertions: Prediction words with no target counterpart.
        deletions: Target words missing from the prediction.
        normalized: Whether words were case-folded and stripped of punctuation before aligning.
    """

    score: float
    distance: int
    n_pred: int
    n_target: int
    first_error: int
    a_matched: int
    b_matched: int
    a_accuracy: float
    b_accuracy: float
    substitutions: int
    insertions: int
    deletions: int
    normalized: bool

    @property
    def relative_first_error(self) -> float:
        """``first_error / n_target``: 1.0 when the alignment never departs from the target."""
        return self.first_error / self.n_target if self.n_target else 1.0

    @property
    def copies_one_fragment(self) -> bool:
        """One stream at least 80% matched and the other at most 20%: an answer that holds one stream, not two.

        A copy of one fragment scores 0.5 at every length, so this share says how much of a score comes from it."""
        high, low = max(self.a_accuracy, self.b_accuracy), min(self.a_accuracy, self.b_accuracy)
        return high >= 0.8 and low <= 0.2


def words(text: str, normalize: bool = False) -> list[str]:
    """Split text into words on whitespace, optionally case-folded and stripped of punctuation.

    Normalisation removes every character that is not a letter, digit or underscore, but keeps a token that
    becomes empty (as ``""``), so the number of words and the A/B positions never change.

    Args:
        text: Any text.
        normalize: Case-fold and strip punctuation from each word.

    Returns:
        The words, in order.
    """
    if not normalize:
        return text.split()
    return [w if w.isalnum() else _NOT_WORD_CHAR.sub("", w) for w in text.casefold().split()]


def distance(prediction: str, target: str, normalize: bool = False) -> int:
    """Word-level unit-cost edit distance between prediction and target (see `words` for `normalize`)."""
    return _word_distance(words(prediction, normalize), words(target, normalize))


def score(prediction: str, target: str, normalize: bool = False) -> float:
    """Alignment score in [0, 1]: ``1 - distance / max(n_pred, n_target)``, 1.0 when both are empty."""
    pred, tgt = words(prediction, normalize), words(target, normalize)
    return _ratio(_word_distance(pred, tgt), len(pred), len(tgt))


def align(prediction: str, target: str, normalize: bool = False) -> Alignment:
    """Align prediction to target word by word and describe the optimal alignment (ties: see the module doc).

    Args:
        prediction: The model's answer.
        target: The interleaved reference ``a1 b1 a2 b2 ...``.
        normalize: Case-fold and strip punctuation first (see `words`); recorded in the result.

    Returns:
        The alignment's diagnostics.
    """
    pred, tgt = words(prediction, normalize), words(target, normalize)
    return _summarize(_alignment_runs(pred, tgt), len(pred), len(tgt), normalize)


def score_batch(predictions: Sequence[str], targets: Sequence[str], normalize: bool = False) -> list[float]:
    """`score` of each (prediction, target) pair.

    Raises:
        ValueError: If the two sequences differ in length.
    """
    return [score(p, t, normalize) for p, t in zip(predictions, targets, strict=True)]


def align_batch(predictions: Sequence[str], targets: Sequence[str], normalize: bool = False) -> list[Alignment]:
    """`align` of each (prediction, target) pair.

    Raises:
        ValueError: If the two sequences differ in length.
    """
    return [align(p, t, normalize) for p, t in zip(predictions, targets, strict=True)]


def reference_distance(prediction: str, target: str, normalize: bool = False) -> int:
    """The plain O(n*m) dynamic programme over words: slow, obviously right; for tests and benchmarks only."""
    pred, tgt = words(prediction, normalize), words(target, normalize)
    previous = list(range(len(tgt) + 1))
    for i, p in enumerate(pred, 1):
        current = [i]
        for j, t in enumerate(tgt, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (p != t)))
        previous = current
    return previous[-1]


def _ratio(dist: int, n_pred: int, n_target: int) -> float:
    longest = max(n_pred, n_target)
    return 1.0 - dist / longest if longest else 1.0


def _encode(pred: list[str], target: list[str]) -> tuple[list[int], list[int], int]:
    """Integer ids: shared words ``0..k-1``, the target's other words ``k``, the prediction's ``k + 1``.

    Returns:
        Prediction ids, target ids and the number of symbols ``k + 2``.
    """
    shared = set(pred).intersection(target)
    k = len(shared)
    get = dict(zip(shared, range(k), strict=True)).get
    # map() with a default per word runs the lookups in C: encoding, not the distance, dominates `score`.
    return list(map(get, pred, repeat(k + 1))), list(map(get, target, repeat(k))), k + 2


def _word_distance(pred: list[str], target: list[str]) -> int:
    if pred == target:
        return 0
    pred_ids, target_ids, _ = _encode(pred, target)
    return Levenshtein.distance(pred_ids, target_ids)


def _alignment_runs(pred: list[str], target: list[str]) -> list[tuple[str, int]]:
    """The optimal alignment as runs of edlib's operations, first to last: ``[("=", 3), ("D", 1), ...]``."""
    if pred == target:
        return [("=", len(pred))] if pred else []
    if not pred or not target:
        return [("I", len(pred))] if pred else [("D", len(target))]
    pred_ids, target_ids, n_symbols = _encode(pred, target)
    if n_symbols <= EDLIB_MAX_SYMBOLS and _edlib_traces_back(len(pred_ids), len(target_ids)):
        return _edlib_runs(pred_ids, target_ids)
    return _bitparallel_runs(pred_ids, target_ids)


def _edlib_traces_back(n_query: int, n_target: int) -> bool:
    """Whether edlib finds the path by full traceback (its own size rule) rather than by Hirschberg."""
    blocks = -(-n_query // 64)  # per block and target word edlib keeps two 64-bit vectors and an int score
    return (2 * 8 + 4) * blocks * n_target + 2 * 4 * n_target < _EDLIB_TRACEBACK_BYTES


def _edlib_runs(pred_ids: list[int], target_ids: list[int]) -> list[tuple[str, int]]:
    """edlib's path with the prediction as query: ``I`` = extra prediction word, ``D`` = missing target word."""
    cigar = edlib.align(bytes(pred_ids), bytes(target_ids), task="path")["cigar"]
    return [(op, int(count)) for count, op in _CIGAR.findall(cigar)]


def _bitparallel_runs(pred: list[int], target: list[int]) -> list[tuple[str, int]]:
    """Exact alignment for any vocabulary: Myers/Hyyrö bit-parallel DP in Python integers, then edlib's traceback.

    Bit ``i - 1`` of a column's vectors describes DP row ``i`` (prediction prefix of ``i`` words), one column per
    target word, as in edlib. Walking back from the last cell, an insertion is optimal where the vertical delta
    ``D[i][c] - D[i-1][c]`` is +1, a deletion where the horizontal delta ``D[i][c] - D[i][c-1]`` is +1; otherwise
    the diagonal is. Both arbitrary-size vectors are kept per column for that walk.

    Args:
        pred: Prediction word ids (the query).
        target: Target word ids.

    Returns:
        Runs of operations, first to last, as `_edlib_runs` gives them.
    """
    n = len(pred)
    masks: dict[int, int] = {}
    for i, w in enumerate(pred):
        masks[w] = masks.get(w, 0) | 1 << i
    full = (1 << n) - 1
    pv, mv = full, 0  # column 0: D[i][0] = i, every vertical delta +1
    vertical_up: list[int] = []  # per target word: rows whose vertical delta is +1
    horizontal_up: list[int] = []  # per target word: rows whose horizontal delta is +1
    for w in target:
        eq = masks.get(w, 0)
        xv = eq | mv
        xh = (((eq & pv) + pv) ^ pv) | eq
        ph = mv | ((xh | pv) ^ full)  # XOR with `full` is NOT within n bits, and keeps the integer non-negative
        mh = pv & xh
        horizontal_up.append(ph)
        ph = ph << 1 | 1  # row 0 is D[0][c] = c: its horizontal delta is always +1
        pv = (mh << 1 | ~(xv | ph)) & full  # bits past row n would grow the integers every column
        mv = ph & xv
        vertical_up.append(pv)

    ops = []
    i, c = n, len(target)
    while i and c:
        row = 1 << (i - 1)
        if vertical_up[c - 1] & row:
            ops.append("I")
            i -= 1
        elif horizontal_up[c - 1] & row:
            ops.append("D")
            c -= 1
        else:
            ops.append("=" if pred[i - 1] == target[c - 1] else "X")
            i -= 1
            c -= 1
    path = "I" * i + "D" * c + "".join(reversed(ops))
    return [(run[0], len(run)) for run in _RUNS.findall(path)]


def _summarize(runs: list[tuple[str, int]], n_pred: int, n_target: int, normalized: bool) -> Alignment:
    """Count matches per stream, edits by kind and the first departure along the runs of an alignment."""
    position = 0  # index of the next target word
    first_error = n_target
    a_matched = b_matched = substitutions = insertions = deletions = 0
    for op, count in runs:
        if op == "=":
            even = (position + count + 1) // 2 - (position + 1) // 2  # even indices in [position, position+count)
            a_matched += even
            b_matched += count - even
        else:
            first_error = min(first_error, position)
            if op == "X":
                substitutions += count
            elif op == "I":
                insertions += count
            else:
                deletions += count
        if op != "I":
            position += count
    dist = substitutions + insertions + deletions
    n_a, n_b = (n_target + 1) // 2, n_target // 2
    return Alignment(
        score=_ratio(dist, n_pred, n_target),
        distance=dist,
        n_pred=n_pred,
        n_target=n_target,
        first_error=first_error,
        a_matched=a_matched,
        b_matched=b_matched,
        a_accuracy=a_matched / n_a if n_a else 1.0,
        b_accuracy=b_matched / n_b if n_b else 1.0,
        substitutions=substitutions,
        insertions=insertions,
        deletions=deletions,
        normalized=normalized,
    )
