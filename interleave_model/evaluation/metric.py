"""`AlignmentScore`: the alignment score as a torchmetrics Metric, with its diagnostics, synced across DDP ranks, and
`stderr_over_texts`, the standard error of a mean score over pairs that share texts."""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from collections.abc import Hashable, Sequence
from itertools import combinations
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat

from interleave_model.evaluation.alignment import Alignment, align_batch

# Every state is a float64 sum (exact for integer counts up to 2**53), reduced across ranks by addition.
_STATES = (
    "pairs",
    "score_sum",
    "exact_matches",
    "relative_first_error_sum",
    "a_matched",
    "a_words",
    "b_matched",
    "b_words",
    "substitutions",
    "insertions",
    "deletions",
    "target_words",
    "pred_words",
    "copies",
)
_NO_TEXT = -1  # the key of a text `update` was not told; `_pair_texts` gives every such pair texts of its own


def stderr_over_texts(scores: Sequence[float], texts: Sequence[tuple[Hashable, Hashable]]) -> float:
    """Standard error of the mean of `scores`, where pairs cut from a common text may be correlated.

    Pair i is cut from the two texts ``texts[i]``, and any two pairs that share a text, in either place, are counted
    as correlated: the dyadic cluster-robust variance (Fafchamps & Gubert 2007; Aronow, Samii & Assenova 2015), a
    CR1-style cluster estimate with the texts as clusters. With residuals ``e_i = x_i - mean`` over n pairs:

        V_texts = T / (T - 1) * (sum_t S_t**2 - sum_d D_d**2) / n**2
        V_pairs = sum_i e_i**2 / (n (n - 1))                   (the pairs taken as independent)
        s.e.    = sqrt(max(V_texts, V_pairs))

    ``S_t`` sums the residuals of the pairs cut from text t, ``D_d`` those of the pairs cut from the same two texts d,
    and T counts the texts. ``sum_t S_t**2`` counts each product ``e_i e_j`` once per text the two pairs share, so two
    pairs of the same two texts twice; ``sum_d D_d**2`` takes one back. V_texts is then the sum of ``e_i e_j`` over
    every two pairs (i = j included) that share a text, over n**2, times CR1's small-sample factor ``T / (T - 1)``.

    V_texts is no sum of squares: with few texts it is noisy and can fall below V_pairs, or below 0. Two pairs that
    share a text share its difficulty, so their covariance is taken to be non-negative and the variance of the mean at
    least V_pairs: the larger of the two is the estimate. When no two pairs share a text, V_texts is
    ``2n / (2n - 1) * sum_i e_i**2 / n**2`` (T = 2n), below V_pairs, and the s.e. is the usual ``sqrt(var / n)``.

    Returns:
        The standard error: 0 when two pairs or more all score the same (no spread, however they share texts); NaN
        below two pairs, and when every two pairs share a text (at most three texts, or one text in every pair):
        V_texts is then ``(sum_i e_i)**2 / n**2 = 0`` whatever the scores, and nothing tells how the texts differ.

    Raises:
        ValueError: If `scores` and `texts` differ in length.
    """
    if len(scores) != len(texts):
        raise ValueError(f"{len(scores)} scores for {len(texts)} pairs of texts")
    n = len(scores)
    if n < 2:
        return math.nan
    if min(scores) == max(scores):
        return 0.0
    distinct = {frozenset(pair) for pair in texts}
    if all(first & second for first, second in combinations(distinct, 2)):
        return math.nan
    mean = math.fsum(scores) / n
    by_text: defaultdict[Hashable, float] = defaultdict(float)  # S_t
    by_pair: defaultdict[frozenset, float] = defaultdict(float)  # D_d
    for score, pair in zip(scores, texts, strict=True):
        residual, own = score - mean, frozenset(pair)
        for text in own:
            by_text[text] += residual
        if len(own) == 2:  # a pair cut twice from one text is in one S_t only: nothing counted twice
            by_pair[own] += residual
    shared = math.fsum(s * s for s in by_text.values()) - math.fsum(d * d for d in by_pair.values())
    over_texts = len(by_text) / (len(by_text) - 1) * shared / n**2
    over_pairs = math.fsum((score - mean) ** 2 for score in scores) / (n * (n - 1))
    return math.sqrt(max(over_texts, over_pairs))


def count_texts(texts: Sequence[tuple[Hashable, Hashable]]) -> int:
    """Distinct texts the pairs were cut from: the clusters `stderr_over_texts` rests on."""
    return len({text for pair in texts for text in pair})


def text_key(text_id: str) -> int:
    """A text id as a non-negative int64, the same in every process (Python's `hash` of a str is salted per process),
    so that ranks can gather texts as tensors; two ids of a corpus share one with odds of about 1 in 2**56 a pair."""
    return int.from_bytes(hashlib.blake2b(text_id.encode(), digest_size=7).digest(), "big")


class AlignmentScore(Metric):
    """Mean word-alignment score of predictions against their interleaved targets, plus where they go wrong.

    `compute()` gives the mean score (so ``self.log(name, metric)`` works); `compute_all()` gives every value,
    synced across processes the same way:

    - ``score``: mean alignment score per pair.
    - ``score_stderr``: its standard error over texts (`stderr_over_texts`): pairs that share a text are counted as
      correlated, so it rests on the texts, not on the pairs, and is never below the one over independent pairs (NaN
      when every two pairs share a text).
    - ``texts``: the distinct texts the pairs were cut from.
    - ``exact_match``: share of pairs whose words equal the target's.
    - ``first_error``: mean over pairs of ``first_error / n_target`` (1.0 when the target is matched in order).
    - ``a_accuracy`` / ``b_accuracy``: matched fragment-A (B) target words over all fragment-A (B) target words.
    - ``substitutions`` / ``insertions`` / ``deletions``: edits of that kind per target word.
    - ``length_ratio``: answer words over target words.
    - ``copy_share``: share of pairs whose answer holds one stream only (`Alignment.copies_one_fragment`).

    A value whose denominator is still zero (no pair yet, or no target word of that kind) is NaN: no data is not
    a score of 0. `update` with empty lists adds nothing. The sums are reduced across ranks by addition; each pair's
    score and texts, which the standard error needs, are gathered (a few numbers a pair).

    Args:
        normalize: Case-fold and strip punctuation before aligning (see `interleave_model.evaluation.alignment.words`).
        kwargs: Passed to `torchmetrics.Metric` (e.g. ``sync_on_compute``).
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, normalize: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.normalize = normalize
        for name in _STATES:
            self.add_state(name, default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        for name in ("pair_scores", "text_a_keys", "text_b_keys"):  # one entry a pair, in update order
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def update(
        self, preds: Sequence[str], targets: Sequence[str], texts: Sequence[tuple[str, str]] | None = None
    ) -> None:
        """Align each prediction with its target and add the results to the sums.

        Args:
            preds: The answers.
            targets: Their targets.
            texts: The ids of the two texts each pair was cut from (`Example.text_a`, `Example.text_b`); without
                them each pair counts as cut from texts of its own, which no other pair shares.

        Raises:
            ValueError: If `preds`, `targets` and `texts` differ in length.
        """
        alignments = align_batch(preds, targets, normalize=self.normalize)
        if texts is not None and len(texts) != len(alignments):
            raise ValueError(f"{len(texts)} pairs of texts for {len(alignments)} predictions")
        if not alignments:
            return
        sums = _sums(alignments)
        for name in _STATES:
            setattr(self, name, getattr(self, name) + sums[name])
        keys = [(text_key(a), text_key(b)) for a, b in texts] if texts is not None else [(_NO_TEXT,) * 2] * len(preds)
        self.pair_scores.append(torch.tensor([a.score for a in alignments], dtype=torch.float64, device=self.device))
        self.text_a_keys.append(torch.tensor([a for a, _ in keys], dtype=torch.int64, device=self.device))
        self.text_b_keys.append(torch.tensor([b for _, b in keys], dtype=torch.int64, device=self.device))

    def compute(self) -> Tensor:
        """Mean alignment score over all pairs seen (on every rank)."""
        return self._values()["score"]

    def compute_all(self) -> dict[str, Tensor]:
        """Every value listed in the class docstring, computed from the states summed across processes."""
        with self.sync_context(dist_sync_fn=self.dist_sync_fn, should_sync=self.sync_on_compute):
            return self._values()

    def _values(self) -> dict[str, Tensor]:
        scores, texts = self._pair_texts()
        return {
            "score": self.score_sum / self.pairs,
            "score_stderr": self._tensor(stderr_over_texts(scores, texts)),
            "texts": self._tensor(count_texts(texts)),
            "exact_match": self.exact_matches / self.pairs,
            "first_error": self.relative_first_error_sum / self.pairs,
            "a_accuracy": self.a_matched / self.a_words,
            "b_accuracy": self.b_matched / self.b_words,
            "substitutions": self.substitutions / self.target_words,
            "insertions": self.insertions / self.target_words,
            "deletions": self.deletions / self.target_words,
            "length_ratio": self.pred_words / self.target_words,
            "copy_share": self.copies / self.pairs,
        }

    def _pair_texts(self) -> tuple[list[float], list[tuple[int, int]]]:
        """Each pair's score and its texts' keys, a pair without known texts getting two keys no other pair has."""
        if not isinstance(self.pair_scores, Tensor) and not self.pair_scores:
            return [], []
        scores = dim_zero_cat(self.pair_scores).tolist()
        keys = zip(dim_zero_cat(self.text_a_keys).tolist(), dim_zero_cat(self.text_b_keys).tolist(), strict=True)
        # -2 - 2i and -3 - 2i: below every text key and _NO_TEXT, and different for every pair i
        texts = [(a if a != _NO_TEXT else -2 - 2 * i, b if b != _NO_TEXT else -3 - 2 * i)
                 for i, (a, b) in enumerate(keys)]  # fmt: skip
        return scores, texts

    def _tensor(self, value: float) -> Tensor:
        return torch.tensor(value, dtype=torch.float64, device=self.device)


def _sums(alignments: list[Alignment]) -> dict[str, float]:
    """The batch's contribution to each state."""
    return {
        "pairs": len(alignments),
        "score_sum": sum(a.score for a in alignments),
        "exact_matches": sum(a.distance == 0 for a in alignments),
        "relative_first_error_sum": sum(a.relative_first_error for a in alignments),
        "a_matched": sum(a.a_matched for a in alignments),
        "a_words": sum((a.n_target + 1) // 2 for a in alignments),
        "b_matched": sum(a.b_matched for a in alignments),
        "b_words": sum(a.n_target // 2 for a in alignments),
        "substitutions": sum(a.substitutions for a in alignments),
        "insertions": sum(a.insertions for a in alignments),
        "deletions": sum(a.deletions for a in alignments),
        "target_words": sum(a.n_target for a in alignments),
        "pred_words": sum(a.n_pred for a in alignments),
        "copies": sum(a.copies_one_fragment for a in alignments),
    }
