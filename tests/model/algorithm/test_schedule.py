"""The learning-rate schedule, a pure function of the step."""

from __future__ import annotations

import math

import pytest

from interleave_model.algorithm.schedule import lr_factor, phase_learning_rate


def test_warmup_is_linear_then_cosine_reaches_the_floor():
    # warm-up 3: steps 0, 1, 2 -> 1/4, 2/4, 3/4; step 3 is the peak
    assert [lr_factor(s, 3, 13) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # halfway through the cosine (step 8 of 3..13): 0.1 + 0.9 * 0.5 * (1 + cos(pi/2)) = 0.55
    assert math.isclose(lr_factor(8, 3, 13), 0.55)
    assert math.isclose(lr_factor(13, 3, 13), 0.1) and math.isclose(lr_factor(99, 3, 13), 0.1)


def test_constant_and_unknown_total_stay_flat():
    assert lr_factor(50, 0, 100, "constant") == 1.0
    assert lr_factor(50, 0, -1) == 1.0


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="lr_schedule must be one of"):
        lr_factor(0, 0, 10, "linear")


def test_grpo_warms_up_from_where_the_warm_start_ended():
    def grpo(step, grpo_start=None):  # GRPO at 1e-3, warm-up 3, constant; SFT planned for 100 steps
        return phase_learning_rate("grpo", step, 1000, 1e-3, 1e-2, 3, 100, "constant", grpo_start)

    # warm-up 3: 1/4, 2/4, 3/4, 1 of the rate from GRPO's first step
    assert [grpo(s) for s in (100, 101, 102, 103)] == [2.5e-4, 5e-4, 7.5e-4, 1e-3]
    # the warm-start ended at step 40: the same warm-up from there, not a rate held at 1/4 until step 100
    assert [grpo(s, grpo_start=40) for s in (40, 41, 42, 43, 99)] == [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3]
