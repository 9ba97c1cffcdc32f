"""Which lengths a held-out check of fit runs, and the batch sampler that serves a length only at those checks.

A check at every `eval_stages` length costs the most at the longest ones, where a model early in its curriculum scores
next to nothing and nothing is decided. So during fit a check runs the lengths whose score decides something
(`deciding_lengths`), and the whole curve where it is read: at the check after a stage is passed and at the check
that ends fit (`InterleaveDataModule.held_out_lengths`). A length's pairs, batches and their order are the same at
every check that runs it, so each decision reads the score it would read if every check ran every length.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from torch.utils.data import BatchSampler, Sampler

from interleave_data.curriculum import Curriculum

PASSES = ("advance", "milestone", "done")  # the curriculum's history entries that end a stage


def stages_passed(history: Iterable[dict]) -> int:
    """Stage ends in a curriculum's history: a fixed stage learned, a milestone passed, the last one done. A stage
    passed again after a step back counts again."""
    return sum(entry["kind"] in PASSES for entry in history)


def deciding_lengths(curriculum: Curriculum, next_batch: int, sft_stages: Sequence[int] | None) -> set[int]:
    """The lengths whose held-out score decides something at a check before training batch `next_batch`.

    The stage (milestone) worked towards, whose score passes it (`val_threshold`) or ends the warm start
    (`warm_start_until`); the stages passed, whose scores show whether replay keeps them; and while the warm start
    runs, the lengths it trains on (`sft_stages`).
    """
    lengths = set(curriculum.stages[: curriculum.state.stage_index + 1])
    if curriculum.warm_start(next_batch):
        lengths |= set(sft_stages or ())
    return lengths


def checked_lengths(eval_lengths: Sequence[int], deciding: set[int], whole: bool) -> list[int]:
    """The evaluation lengths a check runs: all of them for the whole curve, else those in `deciding`; all of them too
    when none is (a check is never empty)."""
    chosen = [n for n in eval_lengths if n in deciding]
    return list(eval_lengths) if whole or not chosen else chosen


class HeldOutBatches(BatchSampler):
    """One length's held-out batches, in order, at a check that runs the length; none at a check that does not.

    A batch sampler rather than a new loader per check: Lightning builds the validation loaders once per fit, and under
    DDP re-creates this sampler around its distributed one (the `sampler` argument), as it does a plain
    `BatchSampler`, so each rank serves its share of the same pairs. Its size stays the length's batch count.

    Args:
        sampler: The indices of the length's pairs, in order.
        batch_size: Pairs per batch.
        drop_last: Drop a last, smaller batch.
        runs: Whether the check under way runs this length.
    """

    def __init__(self, sampler: Sampler[int], batch_size: int, drop_last: bool, runs: Callable[[], bool]) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.runs = runs

    def __iter__(self) -> Iterator[list[int]]:
        return super().__iter__() if self.runs() else iter(())
