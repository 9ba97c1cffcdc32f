"""The learning-rate schedule, a pure function of the step."""

from __future__ import annotations

import math

import pytest

from interleave_model.schedule import lr_factor


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
