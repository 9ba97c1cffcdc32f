"""Reference guidance (CHORD-mu): its cross-entropy alone moves the policy when the group has nothing to teach."""

from __future__ import annotations

import pytest
import torch

from interleave_model.algorithm.rewards import RewardFunction
from tests.conftest import fit_one_grpo_step


class Same(RewardFunction):
    """Every completion scores alike: every advantage is 0 and GRPO's gradient vanishes."""

    def __call__(self, completions, targets, truncated):
        return [0.5] * len(completions)


@pytest.mark.parametrize("guidance", [0.0, 0.5])
def test_only_the_guidance_moves_the_policy_when_every_answer_scores_alike(make_module, make_datamodule, guidance):
    module = make_module(
        rewards=[Same()],
        kl={"beta": 0.0},
        guidance={"weight": guidance} if guidance else None,
        optimization={"learning_rate": 1e-2},
    )
    before = [p.detach().clone() for p in module.policy.parameters()]
    trainer = fit_one_grpo_step(module, make_datamodule, batch_size=2)

    moved = any(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters(), strict=True))
    assert moved == (guidance > 0)
    logged = trainer.callback_metrics
    assert ("train/guidance" in logged) == (guidance > 0)
    if guidance:
        assert logged["train/guidance"].item() == 0.5 and logged["train/guidance_loss"].item() > 0


@pytest.mark.parametrize("settings", [{"weight": 1.5}, {"weight": 0.0}])
def test_a_setting_out_of_range_is_refused_naming_the_key(settings):
    from interleave_model.settings.loss import Guidance

    (name,) = settings
    with pytest.raises(ValueError, match=f"model.guidance.{name} must be"):
        Guidance(**settings)
