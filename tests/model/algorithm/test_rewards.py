"""Reward functions and their weighted sum."""

from __future__ import annotations

import pytest

from interleave_model.algorithm.rewards import AlignmentReward, RewardFunction, combine


class Constant(RewardFunction):
    """The same reward for every completion; all instances share one name."""

    name = "constant"

    def __init__(self, value: float, weight: float = 1.0) -> None:
        super().__init__(weight)
        self.value = value

    def __call__(self, completions, targets, truncated):
        return [self.value] * len(completions)


def test_functions_sharing_a_name_all_count_and_are_all_logged():
    # 1.0 * 0.25 + 2.0 * 0.5 + 0.5 * 1.0 = 0.25 + 1.0 + 0.5 = 1.75 for each of the two completions
    functions = [Constant(0.25), Constant(0.5, weight=2.0), Constant(1.0, weight=0.5)]
    total, terms = combine(functions, ["a b", "b a"], ["a b", "a b"], [False, False])
    assert total == [1.75, 1.75]
    assert terms == {"constant": [0.25, 0.25], "constant_2": [0.5, 0.5], "constant_3": [1.0, 1.0]}


class Cut(RewardFunction):
    """-1 for an answer that ran out of its budget."""

    name = "cut"

    def __call__(self, completions, targets, truncated):
        return [-float(cut) for cut in truncated]


def test_alignment_and_another_term_are_weighted_and_summed():
    # "a b c" vs target "a b": alignment 1 - 1 edit / 3 words = 2/3; truncated: -1 at weight 0.1
    total, terms = combine([AlignmentReward(), Cut(weight=0.1)], ["a b c"], ["a b"], [True])
    assert terms["cut"] == [-1.0]
    assert total == pytest.approx([2 / 3 - 0.1])


def test_a_function_returning_the_wrong_count_is_refused():
    class Short(RewardFunction):
        def __call__(self, completions, targets, truncated):
            return [1.0]

    with pytest.raises(ValueError):
        combine([Short()], ["a", "b"], ["a", "b"], [False, False])


class Recording(RewardFunction):
    """Keeps the keyword arguments it was called with (TRL's convention: `**kwargs`); rewards 0."""

    name = "recording"

    def __call__(self, completions, targets, truncated, **fields):
        self.fields = fields
        return [0.0] * len(completions)


FIELDS = {"prompts": ["Q1", "Q2"], "a": ["x y", "u v"], "b": ["1 2", "3 4"], "n_words": [2, 2], "ids": ["i", "j"]}


def test_a_reward_taking_kwargs_gets_every_field_by_name():
    reward = Recording()
    combine([reward], ["x 1", "u"], ["x 1 y 2", "u 3 v 4"], [False, True], **FIELDS)
    assert reward.fields == FIELDS


def test_a_reward_naming_some_fields_gets_those_alone():
    class ReadsThePrompt(RewardFunction):
        def __call__(self, completions, targets, truncated, *, prompts, a):
            self.seen = prompts, a
            return [float(p.endswith("2")) for p in prompts]

    reward = ReadsThePrompt()
    total, _ = combine([reward], ["x 1", "u"], ["x 1 y 2", "u 3 v 4"], [False, False], **FIELDS)
    assert total == [0.0, 1.0] and reward.seen == (FIELDS["prompts"], FIELDS["a"])


def test_a_three_argument_reward_and_the_shipped_ones_score_alike_with_fields():
    completions, targets, cut = ["x 1 y 2", "u"], ["x 1 y 2", "u 3 v 4"], [False, True]
    functions = [Constant(0.5), AlignmentReward(), Cut()]  # Constant and Cut take 3 arguments
    assert combine(functions, completions, targets, cut, **FIELDS) == combine(functions, completions, targets, cut)
