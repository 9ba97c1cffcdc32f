"""The training length as a difficulty that follows the model: AdaRFT's rule on words per fragment.

AdaRFT (Shi et al. 2025, arXiv 2504.05520) moves a target difficulty after every batch by
`T' = clip(T + eta * tanh(alpha * (R - beta)))`, where `R` is the batch's success rate: the samples are kept where they
succeed about a `beta` share of the time, which is where a group's answers differ and GRPO has a gradient. Here the
difficulty is the fragment length and the rule moves its logarithm, so a step is a bounded *share* of the length
(10 -> 10.4 words and 200 -> 208 alike), never under the first length nor over the next milestone not yet passed.
Pure functions; the Curriculum calls them and keeps their state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from interleave_data.corpus import CorpusError

SENSITIVITY = 2.0  # AdaRFT's alpha: a rate 0.5 away from the target gives tanh(1) = 0.76 of a full step
REPLAY_SPREAD = 0.5  # replayed rows at lengths in [length / 2, length)


@dataclass(frozen=True)
class AdaptiveLength:
    """How the training length follows the sampled success (`data.curriculum.adaptive`).

    Attributes:
        success: Alignment score from which a sampled answer counts as a success.
        target: The share of the batch's samples at its length that reach `success` (the rule's `R`) the length
            aims the samples at (AdaRFT's beta). AdaRFT's own `R`, the mean reward, climbed on answers worth half
            here (docs/RESULTS.md, "Tried and dropped").
        step: The largest change of the length's logarithm per batch (AdaRFT's eta): 0.05 is at most about 4% of
            the length per batch after the tanh.

    AdaRFT's alpha in `tanh(alpha * (rate - target))` is `SENSITIVITY`, and replayed rows (`data.replay_fraction`) take
    lengths drawn uniformly from `[length * (1 - REPLAY_SPREAD), length)`, never under the first length: the lengths
    climbed most lately. Neither was ever varied here, so neither is a setting.
    """

    success: float = 0.9
    target: float = 0.5
    step: float = 0.05

    def __post_init__(self) -> None:
        if not 0.0 < self.success <= 1.0 or not 0.0 < self.target < 1.0:
            raise CorpusError(
                f"curriculum.adaptive: need 0 < success <= 1 and 0 < target < 1, got {self.success}, {self.target}"
            )
        if self.step <= 0:
            raise CorpusError(f"curriculum.adaptive: need step > 0, got {self.step}")


def next_level(level: float, rate: float, settings: AdaptiveLength, low: int, high: int) -> float:
    """The continuous length after a batch whose samples succeed at `rate`, clipped to `[low, high]`.

    `log level' = log level + step * tanh(SENSITIVITY * (rate - target))`. For example at 20 words with step 0.05,
    target 0.5: rate 1.0 gives 20 * exp(0.05 * tanh(1)) = 20.78, rate 0.5 stays at 20, rate 0
    gives 19.25.
    """
    moved = level * math.exp(settings.step * math.tanh(SENSITIVITY * (rate - settings.target)))
    return min(max(moved, float(low)), float(high))


def words_of(level: float) -> int:
    """The length batches are drawn at: the continuous level rounded half up (`round` would round 10.5 to 10)."""
    return math.floor(level + 0.5)


def replay_range(words: int, first: int, spread: float) -> range:
    """The lengths replayed beside training at `words`: `[max(first, ceil(words * (1 - spread))), words)`."""
    return range(max(first, math.ceil(words * (1.0 - spread))), words)
