"""The learning-rate schedule: `lr_factor`, a pure function of the step, and `PhaseSchedule`, the optimizer's
scheduler holding each phase's rate."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from interleave_model.algorithm.schedule import PhaseSchedule, lr_factor
from interleave_model.settings.optimization import Optimization


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


def _schedule(phases, max_steps=1000, **settings) -> PhaseSchedule:
    """A schedule over one parameter's AdamW; `phases` is read at each step, as the module's curriculum is."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return PhaseSchedule(optimizer, Optimization(**settings), max_steps, lambda: phases)


def test_grpo_warms_up_from_where_the_warm_start_ended():
    # GRPO at 1e-3, warm-up 3, constant; SFT planned for 100 steps
    settings = {"learning_rate": 1e-3, "sft_learning_rate": 1e-2, "warmup_steps": 3, "lr_schedule": "constant"}
    planned = _schedule(SimpleNamespace(sft_steps=100, grpo_start=100), **settings)
    # warm-up 3: 1/4, 2/4, 3/4, 1 of the rate from GRPO's first step
    assert [planned.at("grpo", s) for s in (100, 101, 102, 103)] == [2.5e-4, 5e-4, 7.5e-4, 1e-3]
    # the warm-start ended at step 40: the same warm-up from there, not a rate held at 1/4 until step 100
    ended = _schedule(SimpleNamespace(sft_steps=100, grpo_start=40), **settings)
    assert [ended.at("grpo", s) for s in (40, 41, 42, 43, 99)] == [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3]


def test_each_phase_has_its_rate_and_the_optimizer_steps_at_it():
    # SFT 4 steps from 1e-2, GRPO from step 4 to 10 at 1e-3, warm-up 1 in each, cosine to 10%
    schedule = _schedule(SimpleNamespace(sft_steps=4, grpo_start=4), max_steps=10, learning_rate=1e-3,
                         sft_learning_rate=1e-2, warmup_steps=1, lr_schedule="cosine")  # fmt: skip
    rates = [schedule.at("sft" if step < 4 else "grpo", step) for step in range(11)]
    # SFT: 1/2 of the rate, then the cosine over steps 1..4: at 0, 1/3, 2/3 of the way 1, 0.775, 0.325
    # (0.1 + 0.9 * 0.5 * (1 + cos(pi / 3)) = 0.775); GRPO: the same over steps 5..10, its sixths
    sft = [0.5, 1.0, 0.775, 0.325]
    grpo = [0.5] + [0.1 + 0.45 * (1 + math.cos(math.pi * k / 5)) for k in range(6)]
    assert rates == pytest.approx([1e-2 * f for f in sft] + [1e-3 * f for f in grpo])
    assert schedule.optimizer.param_groups[0]["lr"] == rates[-1] == pytest.approx(1e-4)  # the floor, at max_steps


def test_without_a_curriculum_grpo_starts_at_step_0():
    schedule = _schedule(None, max_steps=4, learning_rate=1e-3, warmup_steps=1, lr_schedule="cosine")
    assert [schedule.at("grpo", step) for step in range(2)] == [5e-4, 1e-3]


def test_the_phases_are_read_at_each_step():
    # a held-out check ends the warm start at step 2 of 10 planned: GRPO's warm-up starts there
    phases = SimpleNamespace(sft_steps=10, grpo_start=10)
    schedule = _schedule(phases, learning_rate=1e-3, warmup_steps=1)
    assert schedule.at("sft", 1) == 1e-3  # the warm start's default rate, past its warm-up
    phases.grpo_start = 2
    assert [schedule.at("grpo", step) for step in (2, 3)] == [5e-4, 1e-3]  # from 10, step 3 would warm up still


def test_a_resumed_schedule_continues_at_the_same_rates():
    """Nothing is saved: a schedule built anew at a resume, handed the saved state (or an older checkpoint's none),
    gives the rates the first one would have, and a resume with a new rate uses it."""
    phases, settings = SimpleNamespace(sft_steps=3, grpo_start=3), {"warmup_steps": 2, "lr_schedule": "cosine"}
    first = _schedule(phases, max_steps=12, **settings)
    straight = [first.at("sft" if step < 3 else "grpo", step) for step in range(12)]
    assert first.state_dict() == {}
    resumed = _schedule(phases, max_steps=12, **settings)
    resumed.load_state_dict(first.state_dict())
    assert [resumed.at("sft" if step < 3 else "grpo", step) for step in range(6, 12)] == straight[6:]
    faster = _schedule(phases, max_steps=12, learning_rate=2e-5, **settings)
    assert faster.at("grpo", 8) == 2 * straight[8]
