"""`AlignmentScore`: the alignment score as a torchmetrics Metric, with its diagnostics, summed across DDP ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from interleave_model.evaluation.alignment import Alignment, align_batch

# Every state is a float64 sum (exact for integer counts up to 2**53), reduced across ranks by addition.
_STATES = (
    "pairs",
    "score_sum",
    "score_sq_sum",
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


class AlignmentScore(Metric):
    """Mean word-alignment score of predictions against their interleaved targets, plus where they go wrong.

    `compute()` gives the mean score (so ``self.log(name, metric)`` works); `compute_all()` gives every value,
    synced across processes the same way:

    - ``score``: mean alignment score per pair.
    - ``score_stderr``: its standard error, ``sqrt(sample variance / pairs)`` (NaN below two pairs).
    - ``exact_match``: share of pairs whose words equal the target's.
    - ``first_error``: mean over pairs of ``first_error / n_target`` (1.0 when the target is matched in order).
    - ``a_accuracy`` / ``b_accuracy``: matched fragment-A (B) target words over all fragment-A (B) target words.
    - ``substitutions`` / ``insertions`` / ``deletions``: edits of that kind per target word.
    - ``length_ratio``: answer words over target words.
    - ``copy_share``: share of pairs whose answer holds one stream only (`Alignment.copies_one_fragment`).

    A value whose denominator is still zero (no pair yet, or no target word of that kind) is NaN: no data is not
    a score of 0. `update` with empty lists adds nothing.

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

    def update(self, preds: Sequence[str], targets: Sequence[str]) -> None:
        """Align each prediction with its target and add the results to the sums.

        Raises:
            ValueError: If `preds` and `targets` differ in length.
        """
        sums = _sums(align_batch(preds, targets, normalize=self.normalize))
        for name in _STATES:
            setattr(self, name, getattr(self, name) + sums[name])

    def compute(self) -> Tensor:
        """Mean alignment score over all pairs seen (on every rank)."""
        return self._values()["score"]

    def compute_all(self) -> dict[str, Tensor]:
        """Every value listed in the class docstring, computed from the states summed across processes."""
        with self.sync_context(dist_sync_fn=self.dist_sync_fn, should_sync=self.sync_on_compute):
            return self._values()

    def _values(self) -> dict[str, Tensor]:
        return {
            "score": self.score_sum / self.pairs,
            "score_stderr": _stderr(self.score_sum, self.score_sq_sum, self.pairs),
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


def _sums(alignments: list[Alignment]) -> dict[str, float]:
    """The batch's contribution to each state."""
    return {
        "pairs": len(alignments),
        "score_sum": sum(a.score for a in alignments),
        "score_sq_sum": sum(a.score**2 for a in alignments),
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


def _stderr(total: Tensor, squares: Tensor, n: Tensor) -> Tensor:
    """Standard error of a mean from the sum, the sum of squares and the count: NaN below two values."""
    if n < 2:
        return torch.full((), float("nan"), dtype=torch.float64)
    variance = (squares - total**2 / n).clamp(min=0) / (n - 1)
    return (variance / n).sqrt()
