"""Reference guidance (CHORD): the weight's schedule, the phi-weighted loss by hand, that it alone moves the policy
when the group has nothing to teach, and that the plain cross-entropy (CHORD-mu) is the term when asked."""

from __future__ import annotations

import math

import pytest
import torch

from interleave_model.algorithm.guidance import guidance_weight, phi_sft_loss
from interleave_model.algorithm.rewards import RewardFunction
from tests.conftest import fit_one_grpo_step


def test_the_weight_falls_by_a_cosine_from_start_to_final_then_stays():
    assert guidance_weight(0, 0.5, 0.1, 10) == 0.5
    assert guidance_weight(5, 0.5, 0.1, 10) == pytest.approx(0.3)  # half-way: the mean of the two
    assert guidance_weight(10, 0.5, 0.1, 10) == pytest.approx(0.1)
    assert guidance_weight(99, 0.5, 0.1, 10) == pytest.approx(0.1)
    assert guidance_weight(99, 0.5, 0.1, 0) == 0.5  # no decay


def test_phi_sft_loss_by_hand():
    # token 1: logits (0, 0), label 0 -> p = 0.5, phi = 0.25, term 0.25 * ln 2 = 0.173287
    # token 2: logits (ln 3, 0), label 0 -> p = 0.75, phi = 0.1875, term 0.1875 * -ln 0.75 = 0.053940
    # token 3: ignored. Mean over the two counted tokens: 0.113614
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [5.0, -5.0]]], requires_grad=True)  # [1, 3, 2]
    labels = torch.tensor([[0, 0, -100]])  # [1, 3]
    loss = phi_sft_loss(logits, labels)
    assert loss.item() == pytest.approx((0.25 * math.log(2) - 0.1875 * math.log(0.75)) / 2, abs=1e-6)
    loss.backward()
    # phi carries no gradient: d/dlogit0 of -phi * log p = -phi * (1 - p), over 2 tokens
    assert logits.grad[0, 0, 0].item() == pytest.approx(-0.25 * 0.5 / 2, abs=1e-6)
    assert logits.grad[0, 1, 0].item() == pytest.approx(-0.1875 * 0.25 / 2, abs=1e-6)
    assert torch.equal(logits.grad[0, 2], torch.zeros(2))


def test_no_counted_token_is_zero_not_nan():
    assert phi_sft_loss(torch.zeros(1, 2, 3), torch.full((1, 2), -100)).item() == 0.0


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


def test_the_plain_cross_entropy_is_the_term_when_asked(make_module, make_datamodule):
    # phi = p (1 - p) <= 1/4 weighs every token of CHORD-phi's term, so on the same batch and weights the plain
    # cross-entropy (CHORD-mu) is at least four times it; the same function for both would give equal values
    terms = {}
    for name in ("phi", "ce"):
        module = make_module(rewards=[Same()], seed=3, kl={"beta": 0.0}, guidance={"weight": 1.0, "loss": name})
        trainer = fit_one_grpo_step(module, make_datamodule, batch_size=2)
        terms[name] = trainer.callback_metrics["train/guidance_loss"].item()
    assert terms["phi"] > 0 and terms["ce"] >= 4 * terms["phi"]


@pytest.mark.parametrize("settings", [{"weight": 1.5}, {"weight": 0.0}, {"final": 1.5}, {"decay_steps": -1}])
def test_a_setting_out_of_range_is_refused_naming_the_key(settings):
    from interleave_model.settings import Guidance

    (name,) = settings
    with pytest.raises(ValueError, match=f"model.guidance.{name} must be"):
        Guidance(**settings)
