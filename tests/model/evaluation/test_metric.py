"""AlignmentScore: hand-checked values, edge cases, and the same result in one process as summed over two."""

import math
import socket
import statistics
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from interleave_model.evaluation.metric import AlignmentScore

TARGET = "a1 b1 a2 b2 a3 b3 a4 b4"
PREDS = [
    TARGET,  # exact: score 1, never departs
    "a1 b1 a2 a3 b3 a4 b4",  # b2 skipped: score 7/8, first error 3/8, 1 deletion, B 3/4
    "a1 b1 a2 b2 a3",  # truncated: score 5/8, first error 5/8, 3 deletions, A 3/4, B 2/4
    TARGET + " and so on",  # 3 extra words: score 8/11, never departs, 3 insertions
]
TARGETS = [TARGET] * len(PREDS)
SHARDS = (slice(0, 1), slice(1, None))  # uneven halves: 1 pair on rank 0, 3 on rank 1


def test_values_by_hand():
    metric = AlignmentScore()
    metric.update(PREDS, TARGETS)
    values = metric.compute_all()
    expected = {
        "score": (1 + 7 / 8 + 5 / 8 + 8 / 11) / 4,
        "score_stderr": statistics.stdev([1, 7 / 8, 5 / 8, 8 / 11]) / 2,  # sample std over sqrt(4 pairs)
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
    assert all(math.isnan(v.item()) for v in metric.compute_all().values())


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
    for pred, target in zip(PREDS, TARGETS, strict=True):
        metric.update([pred], [target])
    whole = AlignmentScore()
    whole.update(PREDS, TARGETS)
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
        metric.update(PREDS[SHARDS[rank]], TARGETS[SHARDS[rank]])
        torch.save({"compute": metric.compute(), **metric.compute_all()}, out_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_sum_to_one(tmp_path):
    single = AlignmentScore()
    single.update(PREDS, TARGETS)
    expected = {"compute": single.compute(), **single.compute_all()}

    mp.spawn(_rank_values, args=(_free_port(), tmp_path), nprocs=len(SHARDS))
    for rank in range(len(SHARDS)):
        torch.testing.assert_close(torch.load(tmp_path / f"rank{rank}.pt"), expected)
