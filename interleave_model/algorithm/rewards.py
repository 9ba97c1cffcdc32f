"""Reward functions: objects chosen in YAML (`class_path`), each with a weight; the reward is their weighted sum.

To plug in your own scorer (a heuristic, a frozen judge model...), subclass `RewardFunction`, implement `__call__`
returning one float per completion, and name it in the config::

    model:
      rewards:
        - class_path: interleave_model.algorithm.rewards.AlignmentReward
        - class_path: my_package.JudgeReward
          init_args: {weight: 0.5, judge_path: /models/judge}

A reward is called as TRL calls one: the completions, the targets and `truncated` positionally, and the batch's
fields as keyword arguments, one value per completion (`FIELDS`): `prompts` (the formatted prompt, chat template
included), `a` and `b` (the two fragments), `n_words` (words per fragment) and `ids` (the example's id). Take
`**fields` and read what you need; a reward whose `__call__` names only some of them gets those, and one written
with the three positional arguments alone is still called with those::

    class ShortAnswerForLongPrompts(RewardFunction):
        def __call__(self, completions, targets, truncated, *, prompts, **fields):
            return [float(len(c) < len(p)) for c, p in zip(completions, prompts)]
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from interleave_model.evaluation.alignment import score_batch


class RewardFunction:
    """One term of the reward.

    Args:
        weight: Multiplies this term in the summed reward.
    """

    name = "reward"

    def __init__(self, weight: float = 1.0) -> None:
        self.weight = weight

    def __call__(
        self, completions: Sequence[str], targets: Sequence[str], truncated: Sequence[bool], **fields: Sequence
    ) -> list[float]:
        """Score each completion against its target. `truncated[i]` is True when completion i never emitted EOS;
        `fields` are the batch's `FIELDS`, one value per completion."""
        raise NotImplementedError


class AlignmentReward(RewardFunction):
    """Word-level alignment score in [0, 1]: 1 - edit distance / longer length (the evaluation metric itself)."""

    name = "alignment"

    def __call__(
        self, completions: Sequence[str], targets: Sequence[str], truncated: Sequence[bool], **fields: Sequence
    ) -> list[float]:
        return score_batch(completions, targets)


# the batch's fields a reward is handed by name, one value per completion (the collated batch's keys)
FIELDS = ("prompts", "a", "b", "n_words", "ids")


def fields_taken(function) -> tuple[str, ...]:
    """The `FIELDS` `function` accepts as keyword arguments: all of them if it takes `**kwargs`, else those it names
    (none for a reward written with the three positional arguments alone)."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return FIELDS
    named = {
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    }
    return tuple(f for f in FIELDS if f in named)


def combine(
    functions: Sequence[RewardFunction],
    completions: Sequence[str],
    targets: Sequence[str],
    truncated: Sequence[bool],
    **fields: Sequence,
) -> tuple[list[float], dict[str, list[float]]]:
    """Weighted sum of every reward function, and each term's raw values (for logging).

    `fields` (`FIELDS`, one value per completion) reach each function as the keyword arguments it takes. Terms are
    keyed by the function's `name`; a name already taken gets `_2`, `_3`... (`alignment`, `alignment_2`), so two
    functions of one class each count and each get logged.
    """
    total, terms = [0.0] * len(completions), {}
    for function in functions:
        taken = {name: fields[name] for name in fields_taken(function) if name in fields}
        values = function(completions, targets, truncated, **taken)
        key, n = function.name, 2
        while key in terms:
            key, n = f"{function.name}_{n}", n + 1
        terms[key] = values
        total = [t + function.weight * v for t, v in zip(total, values, strict=True)]
    return total, terms
