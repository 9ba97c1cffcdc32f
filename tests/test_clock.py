"""benchmarks/clock.py: the whole fit's seconds (warm start, GRPO and held-out checks) beside the budget's training
seconds, carried across a pause in the clock's state."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from clock import Clock  # noqa: E402


class Ticks:
    """A clock's time source that the test moves by hand."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _trainer() -> SimpleNamespace:
    return SimpleNamespace(datamodule=SimpleNamespace(sft_steps=5), max_steps=100, should_stop=False)


def test_the_fit_seconds_count_a_warm_start_and_checks_the_budget_leaves_out_and_survive_a_pause():
    ticks, trainer = Ticks(), _trainer()
    clock = Clock(minutes=10.0)
    clock.now = ticks
    clock.on_fit_start(trainer, None)
    ticks.t += 30  # supervised batches: the fit's, not the budget's
    clock.on_train_batch_start(trainer, None, {"phase": "grpo"}, 0)
    ticks.t += 20  # a GRPO batch
    clock.on_train_batch_end(trainer, None, None, {"phase": "grpo"}, 0)
    assert clock.seconds() == 20 and clock.fit_seconds() == 50
    state = clock.state_dict()

    resumed = Clock(minutes=10.0)
    resumed.now = ticks
    ticks.t += 1000  # the pause: counted by neither
    resumed.load_state_dict(state)
    resumed.on_fit_start(trainer, None)
    ticks.t += 7
    assert resumed.fit_seconds() == 57 and resumed.seconds() == 20  # no GRPO batch begun in this process yet


def test_a_clock_state_saved_before_the_fit_seconds_loads_with_none_counted():
    ticks, clock = Ticks(), Clock(minutes=1.0)
    clock.now = ticks
    clock.load_state_dict({"spent": 12.0, "evaluating": 3.0, "batches": [], "curve": [], "extra": {}})
    ticks.t += 4
    assert clock.fit_seconds() == 4 and clock.seconds() == 12
