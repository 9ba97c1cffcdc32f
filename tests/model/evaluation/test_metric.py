"""AlignmentScore: hand-checked values, edge cases, and the same result in one process as summed over two; the
standard error over texts (`stderr_over_texts`) by hand."""

import math
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from interleave_model.evaluation.metric import AlignmentScore, count_texts, stderr_over_texts

TARGET = "a1 b1 a2 b2 a3 b3 a4 b4"
PREDS = [
    TARGET,  # exact: score 1, never departs
    "a1 b1 a2 a3 b3 a4 b4",  # b2 skipped: score 7/8, first error 3/8, 1 deletion, B 3/4
    "a1 b1 a2 b2 a3",  # truncated: score 5/8, first error 5/8, 3 deletions, A 3/4, B 2/4
    TARGET + " and so on",  # 3 extra words: score 8/11, never departs, 3 insertions
]
TARGETS = [TARGET] * len(PREDS)
TEXTS = [("p", "q"), ("q", "p"), ("r", "s"), ("p", "r")]  # pairs 1 and 2 share both texts, 1-2-4 share p, 3-4 r
SHARDS = (slice(0, 1), slice(1, None))  # uneven halves: 1 pair on rank 0, 3 on rank 1


def test_stderr_over_texts_by_hand():
    # scores 1, 0.75, 0, 0.25: mean 0.5, residuals e = 0.5, 0.25, -0.5, -0.25
    # per text:  S_p = e1 + e2 + e4 = 0.5, S_q = e1 + e2 = 0.75, S_r = e3 + e4 = -0.75, S_s = e3 = -0.5
    #            sum S_t**2 = 0.25 + 0.5625 + 0.5625 + 0.25 = 1.625
    # per pair of texts: D_pq = e1 + e2 = 0.75, D_rs = -0.5, D_pr = -0.25; sum D_d**2 = 0.5625 + 0.25 + 0.0625 = 0.875
    # V_texts = T / (T - 1) * (1.625 - 0.875) / n**2 = 4 / 3 * 0.75 / 16 = 1 / 16, s.e. 0.25
    # The same 0.75 pair by pair: sum e_i**2 = 0.625, plus twice e_i e_j over the pairs that share a text:
    # 1-2 0.125, 1-4 -0.125, 2-4 -0.0625, 3-4 0.125 (1-3 and 2-3 share none): 0.625 + 2 * 0.0625 = 0.75
    # It is above V_pairs = 0.625 / (4 * 3) = 0.052 (s.e. 0.228 over independent pairs)
    assert stderr_over_texts([1.0, 0.75, 0.0, 0.25], TEXTS) == pytest.approx(0.25)
    assert count_texts(TEXTS) == 4


def test_stderr_over_texts_of_pairs_that_share_no_text_is_the_usual_one():
    # residuals -0.3, -0.1, 0.4: sum e**2 = 0.26; V_texts = 6 / 5 * 0.26 / 3**2 = 0.0347 (T = 2n = 6 texts), the same
    # as the usual sample variance / n = V_pairs = 0.26 / 2 / 3 = 0.0433 up to the small-sample factors (2n / (2n - 1)
    # for n / (n - 1)), and below it: the usual one
    scores, texts = [0.2, 0.4, 0.9], [("a", "b"), ("c", "d"), ("e", "f")]
    assert stderr_over_texts(scores, texts) ** 2 == pytest.approx(0.26 / 2 / 3)
    assert stderr_over_texts([0.2, 0.4], [("a", "a"), ("b", "b")]) ** 2 == pytest.approx(0.02 / 1 / 2)  # a text each


@pytest.mark.parametrize(
    "texts",
    [
        [("a", "b"), ("b", "c"), ("a", "c"), ("b", "a")],  # three texts: every two pairs share one
        [("a", "b"), ("a", "c"), ("d", "a"), ("a", "e")],  # a star: text a in every pair
        [("a", "b")] * 4,  # all from the same two texts
    ],
)
def test_stderr_over_texts_is_nan_when_every_two_pairs_share_a_text(texts):
    # then V = (sum of all residuals)**2 / n**2 = 0 whatever the scores: nothing tells how the texts differ
    assert math.isnan(stderr_over_texts([1.0, 0.0, 0.5, 0.25], texts))
    assert stderr_over_texts([1.0] * 4, texts) == 0.0  # unless nothing differs at all


def test_stderr_over_texts_of_one_pair_is_nan_and_of_equal_scores_zero():
    assert math.isnan(stderr_over_texts([0.5], [("a", "b")])) and math.isnan(stderr_over_texts([], []))
    assert stderr_over_texts([0.1] * 3, [("a", "b"), ("c", "d"), ("a", "c")]) == 0.0


def test_stderr_over_texts_is_never_below_the_one_over_independent_pairs():
    # a path a-b, b-c, c-d: pairs 1-2 and 2-3 share a text, 1-3 none. Residuals (u, -u - w, w) give
    # V_texts * n**2 * (T - 1) / T = u**2 + (u + w)**2 + w**2 - 2u(u + w) - 2w(u + w) = -2uw < 0 for scores 1, 0, 1
    # (u = w = 1/3); V_pairs = (1/9 + 4/9 + 1/9) / (3 * 2) = 1/9, s.e. 1/3
    assert stderr_over_texts([1.0, 0.0, 1.0], [("a", "b"), ("b", "c"), ("c", "d")]) == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        stderr_over_texts([1.0], [])


def test_values_by_hand():
    metric = AlignmentScore()
    metric.update(PREDS, TARGETS, TEXTS)
    values = metric.compute_all()
    expected = {
        "score": (1 + 7 / 8 + 5 / 8 + 8 / 11) / 4,
        "score_stderr": stderr_over_texts([1, 7 / 8, 5 / 8, 8 / 11], TEXTS),  # over the 4 texts (checked above)
        "texts": 4,
        "exact_match": 1 / 4,
        "first_error": (1 + 3 / 8 + 5 / 8 + 1) / 4,
        "a_accuracy": (4 + 4 + 3 + 4) / 16,
        "b_accuracy": (4 + 3 + 2 + 4) / 16,
        "substitutions": 0.0,
        "insertions": 3 / 32,
        "deletions": (1 + 3) / 32,
        "length_ratio": (8 + 7 + 5 + 11) / 32,
        "copy_share": 0.0,  # every answer holds both streams at least half
    }
    assert values.keys() == expected.keys()
    for name, value in expected.items():
        assert values[name].dtype == torch.float64
        assert values[name].item() == pytest.approx(value), name
    assert metric.compute().item() == pytest.approx(expected["score"])


def test_without_texts_every_pair_has_texts_of_its_own():
    metric = AlignmentScore()
    metric.update(PREDS, TARGETS)
    metric.update(PREDS[:1], TARGETS[:1])  # the same answer again: still texts of its own
    scores = [1, 7 / 8, 5 / 8, 8 / 11, 1]
    own = [(f"a{i}", f"b{i}") for i in range(len(scores))]
    values = metric.compute_all()
    assert values["score_stderr"].item() == pytest.approx(stderr_over_texts(scores, own)) and values["texts"] == 10
    with pytest.raises(ValueError, match="1 pairs of texts for 4 predictions"):
        metric.update(PREDS, TARGETS, TEXTS[:1])


def test_two_merged_metrics_equal_one():
    # what DDP's sync does: the sums add up, the pairs' scores and texts are gathered
    first, second, whole = AlignmentScore(), AlignmentScore(), AlignmentScore()
    first.update(PREDS[SHARDS[0]], TARGETS[SHARDS[0]], TEXTS[SHARDS[0]])
    second.update(PREDS[SHARDS[1]], TARGETS[SHARDS[1]], TEXTS[SHARDS[1]])
    whole.update(PREDS, TARGETS, TEXTS)
    first.merge_state(second)
    torch.testing.assert_close(first.compute_all(), whole.compute_all())
    assert first.compute_all()["texts"].item() == 4 and not math.isnan(first.compute_all()["score_stderr"].item())


def test_copy_share_counts_answers_that_hold_one_stream():
    metric = AlignmentScore()
    # A copied (A 4/4, B 0/4); A doubled to the target's length (4/4, 0/4); A then one pair (4/4, 1/4: B <= 0.2 fails
    # at 4 words, so 10 words below); both streams half right (2/4, 2/4)
    metric.update(["a1 a2 a3 a4", "a1 a1 a2 a2 a3 a3 a4 a4", "a1 b1 a2 a3 a4", "a1 b1 a2 b2"], [TARGET] * 4)
    assert metric.compute_all()["copy_share"].item() == 2 / 4
    ten = " ".join(f"a{i} b{i}" for i in range(10))
    metric.reset()
    metric.update([" ".join(f"a{i}" for i in range(10)) + " b9", "a0 b0 a1 b1 a2 b2 a3 b3 a4 b4"], [ten, ten])
    assert metric.compute_all()["copy_share"].item() == 1 / 2  # A and the last B word (B 0.1): a copy; half: not


def test_no_update_gives_nan():
    metric = AlignmentScore()
    with pytest.warns(UserWarning, match="before the ``update``"):
        assert math.isnan(metric.compute().item())
    values = metric.compute_all()
    assert values.pop("texts").item() == 0 and all(math.isnan(v.item()) for v in values.values())


def test_empty_lists_add_nothing_and_empty_predictions_score_zero():
    metric = AlignmentScore()
    metric.update([], [])
    assert math.isnan(metric.compute().item())
    metric.update(["", ""], [TARGET, ""])  # an empty answer scores 0; an empty answer to an empty target scores 1
    assert metric.compute().item() == 0.5
    assert metric.compute_all()["exact_match"].item() == 0.5
    with pytest.raises(ValueError):
        metric.update(["a"], [])


def test_accumulates_over_batches_and_resets():
    metric = AlignmentScore()
    for pred, target, texts in zip(PREDS, TARGETS, TEXTS, strict=True):
        metric.update([pred], [target], [texts])
    whole = AlignmentScore()
    whole.update(PREDS, TARGETS, TEXTS)
    torch.testing.assert_close(metric.compute_all(), whole.compute_all())
    metric.reset()
    metric.update(["x"], ["x"])
    assert metric.compute().item() == 1.0


def test_normalize_is_passed_to_the_alignment():
    pred, target = ["Hello, World!"], ["hello world"]
    plain, normalized = AlignmentScore(), AlignmentScore(normalize=True)
    plain.update(pred, target)
    normalized.update(pred, target)
    assert (plain.compute().item(), normalized.compute().item()) == (0.0, 1.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_values(rank: int, port: int, out_dir: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(SHARDS))
    try:
        metric = AlignmentScore()
        metric.update(PREDS[SHARDS[rank]], TARGETS[SHARDS[rank]], TEXTS[SHARDS[rank]])
        torch.save({"compute": metric.compute(), **metric.compute_all()}, out_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_sum_to_one(tmp_path):
    single = AlignmentScore()
    single.update(PREDS, TARGETS, TEXTS)
    expected = {"compute": single.compute(), **single.compute_all()}

    mp.spawn(_rank_values, args=(_free_port(), tmp_path), nprocs=len(SHARDS))
    for rank in range(len(SHARDS)):
        torch.testing.assert_close(torch.load(tmp_path / f"rank{rank}.pt"), expected)
