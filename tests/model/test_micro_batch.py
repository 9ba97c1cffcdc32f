"""`optimization.micro_batch_size: auto`: the fastest option by measurement (`runtime.fastest`), the sizes the first
GRPO step times, an update that is the chosen size's own (the probe leaves no trace), and a resume that keeps it."""

from __future__ import annotations

import pytest
import torch

from interleave_model.algorithm.rewards import RewardFunction
from interleave_model.module import InterleaveGRPO
from interleave_model.runtime.fastest import fastest
from interleave_model.settings.optimization import Optimization
from tests.conftest import fit_one_grpo_step


def test_the_fastest_option_is_the_one_whose_call_took_least(monkeypatch):
    now, calls = [0.0], []  # a clock that only the calls move
    monkeypatch.setattr("interleave_model.runtime.fastest.time.perf_counter", lambda: now[0])

    def call(option: str, seconds: float):
        def run():
            calls.append(option)
            now[0] += seconds + (10.0 if calls.count(option) == 1 else 0.0)  # a slow first call: the warm-up

        return run

    chosen, seconds = fastest({"a": call("a", 3.0), "b": call("b", 1.0), "c": call("c", 2.0)})
    assert chosen == "b" and seconds == {"a": 3.0, "b": 1.0, "c": 2.0}  # the warm-ups left out
    assert calls == ["a", "a", "b", "b", "c", "c"]


class Length(RewardFunction):
    """Longer answers score more: the groups differ, so the update has a gradient."""

    def __call__(self, completions, targets, truncated):
        return [float(len(c)) for c in completions]


def _module(make_module, micro_batch_size):
    return make_module(
        rewards=[Length()], kl={"beta": 0.0}, sampling={"num_generations": 2},
        optimization={"learning_rate": 1e-2, "micro_batch_size": micro_batch_size},
    )  # fmt: skip


@pytest.mark.parametrize("chosen", [2, None])
def test_auto_times_each_size_once_at_the_first_grpo_step_and_updates_as_that_size_does(
    make_module, make_datamodule, monkeypatch, caplog, tmp_path, chosen
):
    timed = {}

    def rigged(options, repeats=2, device=None):  # runs every probe, as the real one does, and picks `chosen`
        for option, call in options.items():
            before = [p.detach().clone() for p in module.policy.parameters()]
            call()
            timed[option] = all(p.grad is None for p in module.policy.parameters())  # the probe's gradients dropped
            assert all(torch.equal(a, b) for a, b in zip(before, module.policy.parameters(), strict=True))
        return chosen, {option: 1.0 for option in options}

    monkeypatch.setattr("interleave_model.runtime.fastest.fastest", rigged)
    module = _module(make_module, "auto")
    assert module.micro_batch_size == 2  # one group a forward until it is measured
    with caplog.at_level("INFO"):
        trainer = fit_one_grpo_step(module, make_datamodule, batch_size=2)  # 2 prompts x 2 answers: 4 rows
    assert timed == {2: True, None: True}  # one group a forward, then all 4 rows at once
    assert module.micro_batch_size == chosen and f"auto takes {chosen or 4} rows a forward" in caplog.text

    plain = _module(make_module, chosen)
    fit_one_grpo_step(plain, make_datamodule, batch_size=2)
    for ours, theirs in zip(module.policy.parameters(), plain.policy.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)

    path = tmp_path / "auto.ckpt"
    trainer.save_checkpoint(path)
    resumed = InterleaveGRPO.load_from_checkpoint(path)
    assert resumed.micro_batch_size == chosen and resumed._micro_batch_measured


def test_a_size_below_one_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"model\.optimization\.micro_batch_size must be null, auto or >= 1, got 0"):
        Optimization(micro_batch_size=0)
