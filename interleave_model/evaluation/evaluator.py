"""Evaluation beyond the greedy score: pass@k, diversity of sampled answers, and the per-length table.

Pure functions (`pass_at_k`, `distinct_answers`, `self_similarity`, `length_row`) and `SampledAnswers`, a
torchmetrics Metric whose states are sums, so that under DDP every rank computes the same values.

A sample is *correct* when its alignment score reaches `threshold`; the default 1.0 is exact match (the same words
in the same order, whitespace aside). pass@k is the unbiased estimator of Chen et al. (2021, "Evaluating Large
Language Models Trained on Code"): from n >= k samples of which c are correct,
``pass@k = 1 - C(n - c, k) / C(n, k)``, the chance that k samples drawn without replacement hold a correct one.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from itertools import combinations
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from interleave_model.evaluation.alignment import align, score, words
from interleave_model.evaluation.metric import AlignmentScore
from interleave_model.settings.evaluation import resolve_pass_k

GREEDY_KEYS = (
    "score",
    "score_stderr",
    "exact_match",
    "first_error",
    "a_accuracy",
    "b_accuracy",
    "substitutions",
    "insertions",
    "deletions",
    "length_ratio",
    "copy_share",
)
"""Values of `AlignmentScore.compute_all()` that go into a row of the report as measures (its `texts` is a count, like
the pairs)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from `n` samples of which `c` are correct: ``1 - C(n - c, k) / C(n, k)``.

    Computed as ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``, which avoids huge binomials.

    Raises:
        ValueError: Unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k samples holds a correct one
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def distinct_answers(answers: Sequence[str]) -> int:
    """Number of different answers, comparing word sequences (so whitespace differences do not count)."""
    return len({tuple(words(a)) for a in answers})


def self_similarity(answers: Sequence[str]) -> float:
    """Mean alignment score over all pairs of answers: 1.0 when they are all the same, NaN for fewer than two.

    Identical answers are scored once per distinct pair of different answers, so a collapsed group of 16 copies
    costs nothing.
    """
    n = len(answers)
    if n < 2:
        return math.nan
    counts = Counter(" ".join(words(a)) for a in answers)
    total = sum(c * (c - 1) / 2 for c in counts.values())  # identical pairs score 1.0
    for (x, cx), (y, cy) in combinations(counts.items(), 2):
        total += cx * cy * score(x, y)
    return total / (n * (n - 1) / 2)


class SampledAnswers(Metric):
    """pass@k, mean sampled score and diversity of groups of sampled answers, summed across DDP ranks.

    `compute_all()` gives, averaged over prompts:

    - ``pass@k`` for each k in `ks`: the unbiased estimator from the group's n samples.
    - ``sample_score``: mean alignment score of the samples.
    - ``distinct``: number of different answers in a group (1 = collapsed, n = all different).
    - ``self_similarity``: mean pairwise alignment score among a group's samples (1.0 = all the same).

    Args:
        ks: The k of each pass@k; each must be at most the group size passed to `update`.
        threshold: Alignment score a sample needs to count as correct; 1.0 means exact match.
        kwargs: Passed to `torchmetrics.Metric`.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, ks: Sequence[int] = (1,), threshold: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not ks or min(ks) < 1:
            raise ValueError(f"pass@k needs k >= 1, got {list(ks)}")
        self.ks = sorted(set(ks))
        self.threshold = threshold
        zero = torch.zeros((), dtype=torch.float64)
        for name in ("prompts", "score_sum", "distinct_sum", "similarity_sum", "similarity_prompts"):
            self.add_state(name, default=zero.clone(), dist_reduce_fx="sum")
        self.add_state("pass_sum", default=torch.zeros(len(self.ks), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, groups: Sequence[Sequence[str]], targets: Sequence[str]) -> None:
        """Score each group of samples against its target and add the results to the sums.

        Raises:
            ValueError: If `groups` and `targets` differ in length, or a group is smaller than the largest k.
        """
        if len(groups) != len(targets):
            raise ValueError(f"{len(groups)} groups of samples for {len(targets)} targets")
        passes = torch.zeros(len(self.ks), dtype=torch.float64)
        for group, target in zip(groups, targets, strict=True):
            scores = [score(answer, target) for answer in group]
            correct = sum(s >= self.threshold for s in scores)
            passes += torch.tensor([pass_at_k(len(group), correct, k) for k in self.ks], dtype=torch.float64)
            self.score_sum += sum(scores) / len(scores)
            self.distinct_sum += distinct_answers(group)
            if len(group) > 1:
                self.similarity_sum += self_similarity(group)
                self.similarity_prompts += 1
        self.prompts += len(groups)
        self.pass_sum += passes.to(self.pass_sum.device)

    def compute(self) -> Tensor:
        """pass@k for the largest k."""
        return self.pass_sum[-1] / self.prompts

    def compute_all(self) -> dict[str, Tensor]:
        """Every value listed in the class docstring, from the states summed across processes (NaN without data)."""
        with self.sync_context(dist_sync_fn=self.dist_sync_fn, should_sync=self.sync_on_compute):
            values = {f"pass@{k}": self.pass_sum[i] / self.prompts for i, k in enumerate(self.ks)}
            values["sample_score"] = self.score_sum / self.prompts
            values["distinct"] = self.distinct_sum / self.prompts
            values["self_similarity"] = self.similarity_sum / self.similarity_prompts
            return {name: value.clone() for name, value in values.items()}


def length_row(
    n_words: int, pairs: int, greedy: Mapping[str, Tensor | float], sampled: Mapping[str, Tensor | float] | None
) -> dict[str, float | int]:
    """One row of the report: the length, its pair count, the texts they were cut from (which the standard error
    rests on) and every measure as a plain float (NaN stays NaN)."""
    row: dict[str, float | int] = {"n_words": n_words, "pairs": pairs, "texts": int(greedy["texts"])}
    row |= {key: float(greedy[key]) for key in GREEDY_KEYS}
    row |= {key: float(value) for key, value in (sampled or {}).items()}
    return row


def eval_seed(seed: int, n_words: int, batch_idx: int, rank: int) -> int:
    """Seed of the answers sampled for one evaluation batch.

    It depends on the run's seed, the length, the batch and the rank only, so evaluation draws the same answers
    whenever it runs and never moves the training sampler's stream.
    """
    return random.Random(f"{seed}:eval:{n_words}:{batch_idx}:{rank}").getrandbits(63)


class Evaluator(torch.nn.Module):
    """The per-length metrics of validation and test: greedy answers' `AlignmentScore`, sampled ones' `SampledAnswers`.

    Args:
        settings: How to evaluate (`model.evaluation`: samples per prompt, their temperature, pass@k, threshold).
        seed: The run's seed; with the length, the batch and the rank it seeds the sampled answers (`eval_seed`).
    """

    def __init__(self, settings, seed: int) -> None:
        super().__init__()
        self.settings, self.seed = settings, seed
        self.pass_k = resolve_pass_k(settings.num_samples, settings.pass_k)
        self.metrics = torch.nn.ModuleDict()  # length (a str) -> AlignmentScore of greedy answers
        self.sample_metrics = torch.nn.ModuleDict()  # length -> SampledAnswers (when num_samples > 0)

    def answers(
        self, batch: dict, batch_idx: int, rank: int, device: torch.device, sample: Callable[..., list[str]]
    ) -> tuple[list[str], list[list[str]] | None]:
        """One greedy answer per prompt, and `num_samples` sampled ones per prompt (None when 0, or at a length
        `sample_lengths` leaves out).

        `sample(batch, n, temperature, generator)` gives n answers per prompt, group-major; the sampled ones come
        from a generator of their own (`eval_seed`), so they never move the training sampler's stream.
        """
        lengths = self.settings.sample_lengths
        n = self.settings.num_samples if lengths is None or int(batch["n_words"][0]) in lengths else 0
        groups = None
        if n:
            seed = eval_seed(self.seed, batch["n_words"][0], batch_idx, rank)
            texts = sample(batch, n, self.settings.temperature, torch.Generator(device=device).manual_seed(seed))
            groups = [texts[i : i + n] for i in range(0, len(texts), n)]
        return sample(batch, 1, 0.0, None), groups

    def update(self, batch: dict, greedy: list[str], groups: list[list[str]] | None, device: torch.device) -> None:
        """Greedy answers into the length's `AlignmentScore`, with the texts each pair was cut from (its standard
        error is over texts); sampled groups (if any) into its `SampledAnswers`."""
        length = str(batch["n_words"][0])
        if length not in self.metrics:
            self.metrics[length] = AlignmentScore().to(device)
        self.metrics[length].update(greedy, batch["targets"], list(zip(batch["text_a"], batch["text_b"], strict=True)))
        if groups is not None:
            if length not in self.sample_metrics:
                metric = SampledAnswers(self.pass_k, threshold=self.settings.pass_threshold)
                self.sample_metrics[length] = metric.to(device)
            self.sample_metrics[length].update(groups, batch["targets"])

    def table(self, sum_over_ranks: Callable[[Tensor], Tensor]) -> list[dict[str, float | int]]:
        """The table of an evaluation, one `length_row` per length that saw pairs; every metric is reset.

        Every rank runs this: the pair counts are summed over ranks and the metrics synced, so all ranks get the same
        table.
        """
        rows = []
        for length in sorted(self.metrics, key=int):
            greedy = self.metrics[length]
            pairs = int(sum_over_ranks(greedy.pairs).item())
            sampled = self.sample_metrics[length] if length in self.sample_metrics else None
            if pairs:
                values = sampled.compute_all() if sampled is not None else None
                rows.append(length_row(int(length), pairs, greedy.compute_all(), values))
            greedy.reset()
            if sampled is not None:
                sampled.reset()
        return rows


def metric_name(prefix: str, measure: str, n_words: int) -> str:
    """The logged name of a measure at a length: `val/alignment_10w` (the score is logged as "alignment")."""
    return f"{prefix}/{'alignment' if measure == 'score' else measure}_{n_words}w"


def logged_scores(logged: Mapping[str, object], prefix: str = "val") -> dict[int, float]:
    """`{n_words: score}` of every length whose score is among a trainer's `logged` metrics under `prefix`."""
    head, tail = metric_name(prefix, "score", 0).split("0", 1)
    return {int(k[len(head) : -len(tail)]): float(v) for k, v in logged.items()
            if k.startswith(head) and k.endswith(tail) and k[len(head) : -len(tail)].isdigit()}  # fmt: skip


def monitored_lengths(callbacks: Sequence[object], prefix: str = "val") -> set[int]:
    """The lengths whose held-out measures `callbacks` monitor (a `ModelCheckpoint` or `EarlyStopping` on
    `val/alignment_25w`): a check of fit runs them every time, or the monitor would find no value."""
    head, tail = f"{prefix}/", metric_name(prefix, "score", 0).rsplit("0", 1)[1]
    names = [m for m in (getattr(c, "monitor", None) for c in callbacks) if isinstance(m, str)]
    lengths = (m[len(head) : -len(tail)].rsplit("_", 1)[-1] for m in names if m.startswith(head) and m.endswith(tail))
    return {int(n) for n in lengths if n.isdigit()}


def logged_values(rows: Sequence[Mapping[str, float | int]], prefix: str) -> dict[str, float]:
    """Every measure of the table as `metric_name(prefix, measure, n)`; NaNs and counts are left out."""
    values = {}
    for row in rows:
        for name, value in row.items():
            if name not in ("n_words", "pairs", "texts") and not math.isnan(value):
                values[metric_name(prefix, name, row["n_words"])] = value
    return values


def prediction_records(batch: dict, greedy: list[str], groups: list[list[str]] | None) -> list[dict]:
    """One record per prompt: the greedy completion, its alignment diagnostics and any sampled answers."""
    records = []
    for i, text in enumerate(greedy):
        target = batch["targets"][i]
        diagnostics = align(text, target)
        record = {
            "id": batch["ids"][i],
            "n_words": batch["n_words"][i],
            "prompt": batch["prompts"][i],
            "target": target,
            "completion": text,
            "score": diagnostics.score,
            "exact_match": diagnostics.distance == 0,
            "distance": diagnostics.distance,
            "first_error": diagnostics.first_error,
            "relative_first_error": diagnostics.relative_first_error,
            "a_accuracy": diagnostics.a_accuracy,
            "b_accuracy": diagnostics.b_accuracy,
            "substitutions": diagnostics.substitutions,
            "insertions": diagnostics.insertions,
            "deletions": diagnostics.deletions,
            "n_pred": diagnostics.n_pred,
            "n_target": diagnostics.n_target,
        }
        if groups is not None:
            record["samples"] = groups[i]
            record["sample_scores"] = [align(answer, target).score for answer in groups[i]]
        records.append(record)
    return records
