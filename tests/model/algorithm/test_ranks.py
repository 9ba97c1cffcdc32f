"""Statistics over ranks, with the other ranks' share written out by hand."""

from __future__ import annotations

import torch

from interleave_model.algorithm.ranks import mean_over_ranks


def test_mean_over_ranks_takes_every_value_and_the_rank_count_in_one_reduction():
    reductions = []

    def sum_over_two_ranks(x):  # rank 1 logged loss 3.0 and lr 0.5 (the names in sorted order), and counts as 1 rank
        reductions.append(x)
        return x + torch.tensor([3.0, 0.5, 1.0], dtype=x.dtype)

    means = mean_over_ranks({"train/loss": 1.0, "train/lr": 0.5}, sum_over_two_ranks)

    assert means == {"train/loss": 2.0, "train/lr": 0.5}  # (1 + 3) / 2, (0.5 + 0.5) / 2
    assert len(reductions) == 1 and reductions[0].dtype == torch.float64
    assert mean_over_ranks({"train/lr": 1e-5}, lambda x: x) == {"train/lr": 1e-5}  # one process: the values as given
