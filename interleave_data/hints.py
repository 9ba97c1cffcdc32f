"""Hinted GRPO prompts: the answer's first pairs written after the prompt, the rest left to the policy.

A policy that copies one fragment rarely samples an answer that interleaves, so GRPO has little to reinforce. With a
hint, the rollout starts inside a correctly interleaved answer (``a1 b1 ... ah bh``) and continues from pair ``h + 1``;
the reward and the update see only what the policy wrote, scored against the rest of the answer. The hint is part of
the prompt: its tokens condition the rollout and carry no gradient. The most pairs a prompt may be given falls
linearly to none over a number of GRPO batches, so training ends on the task as it is evaluated (held-out prompts
never carry a hint). Prefix hints of this kind are studied as "partial-solution" or "anchor" guidance (QuestA,
arXiv 2507.13266; BREAD, arXiv 2506.17211).
"""

import random
from dataclasses import dataclass, replace

from interleave_data.corpus import CorpusError
from interleave_data.pairs import Example


@dataclass(frozen=True)
class HintSettings:
    """How many pairs of the answer a GRPO prompt is given.

    Attributes:
        pairs: The most pairs a prompt is given at the first GRPO batch; 0 = no hints.
        decay_steps: GRPO batches over which that most falls linearly to 0; 0 = it never falls.
    """

    pairs: int = 0
    decay_steps: int = 0

    def __post_init__(self):
        if self.pairs < 0 or self.decay_steps < 0:
            raise CorpusError(f"data.hints: pairs and decay_steps must be >= 0, got {self.pairs}, {self.decay_steps}")


def most_pairs(settings: HintSettings, grpo_batch: int) -> int:
    """The most pairs a prompt of GRPO batch `grpo_batch` (0 = the first) is given."""
    if settings.decay_steps == 0:
        return settings.pairs
    return round(settings.pairs * max(0.0, 1.0 - grpo_batch / settings.decay_steps))


def draw_pairs(rng: random.Random, examples: list[Example], most: int) -> list[int]:
    """Each example's hint, uniform in 0..`most` pairs and always short of its whole answer."""
    return [rng.randint(0, min(most, e.n_words - 1)) for e in examples]


def split_hint(example: Example, pairs: int) -> tuple[str, Example]:
    """The answer's first `pairs` pairs (the hint), and the example left to answer: the fragments and the answer
    without them, so a reward scores what follows the hint against what should follow it."""
    if pairs == 0:
        return "", example
    a, b, target = example.a.split(), example.b.split(), example.target.split()
    rest = replace(
        example, a=" ".join(a[pairs:]), b=" ".join(b[pairs:]), target=" ".join(target[2 * pairs :])
    )  # fmt: skip
    return " ".join(target[: 2 * pairs]), rest
