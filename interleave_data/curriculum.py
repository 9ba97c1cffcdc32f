"""The curriculum as plain data: stage lengths, when to move on, and how much of earlier stages to replay."""

from collections.abc import Sequence
from dataclasses import dataclass

from interleave_data.corpus import CorpusError
from interleave_data.pairs import check_length


@dataclass(frozen=True)
class Stage:
    """One curriculum stage.

    Attributes:
        n_words: Words per fragment.
        threshold: Mean reward at which the stage counts as learned.
        patience: Consecutive steps the reward must stay at or above ``threshold`` before moving on.
        min_steps: Steps to spend in the stage before moving on is considered.
    """

    n_words: int
    threshold: float = 0.9
    patience: int = 20
    min_steps: int = 50

    def __post_init__(self):
        check_length(self.n_words, "n_words")
        if not 0.0 <= self.threshold <= 1.0:
            raise CorpusError(f"stage {self.n_words}: threshold must be in [0, 1], got {self.threshold}")
        if self.patience < 1 or self.min_steps < 0:
            raise CorpusError(
                f"stage {self.n_words}: patience must be >= 1 and min_steps >= 0, got {self.patience}, {self.min_steps}"
            )


@dataclass(frozen=True)
class Curriculum:
    """Ordered stages of strictly increasing length.

    Attributes:
        stages: The stages, shortest first.
        replay_fraction: Share of each training batch drawn from earlier stages, in [0, 1).
    """

    stages: tuple[Stage, ...]
    replay_fraction: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "stages", tuple(self.stages))
        check_lengths([stage.n_words for stage in self.stages], "stages")
        if not 0.0 <= self.replay_fraction < 1.0:
            raise CorpusError(f"replay_fraction must be in [0, 1), got {self.replay_fraction}")

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], replay_fraction: float = 0.0, **stage_kwargs) -> "Curriculum":
        """Builds a curriculum whose stages share ``stage_kwargs`` (threshold, patience, min_steps)."""
        check_lengths(lengths, "stages")
        return cls(tuple(Stage(n, **stage_kwargs) for n in lengths), replay_fraction)

    @property
    def lengths(self) -> list[int]:
        return [stage.n_words for stage in self.stages]


def check_lengths(lengths: Sequence[int], name: str) -> list[int]:
    """Validates stage lengths: a non-empty sequence of positive integers, strictly increasing.

    Raises:
        CorpusError: Naming ``name`` and the offending values.
    """
    lengths = list(lengths)
    if not lengths:
        raise CorpusError(f"{name} must name at least one length")
    for n in lengths:
        check_length(n, name)
    if any(b <= a for a, b in zip(lengths, lengths[1:], strict=False)):
        raise CorpusError(f"{name} must be strictly increasing, got {' '.join(map(str, lengths))}")
    return lengths
