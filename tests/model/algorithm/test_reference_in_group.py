"""The known answer as one more group member (LUFFY, `model.reference_in_group`): its advantages and shaped loss by
hand, that it alone moves the policy when no sample earns anything, the settings it refuses, and a step on a
real family's folder."""

from __future__ import annotations

import math

import pytest
import torch

from interleave_model.algorithm.grpo import group_advantages
from interleave_model.algorithm.reference_in_group import mixed_group_advantages, shaped_reference_loss
from interleave_model.algorithm.rewards import RewardFunction
from tests.conftest import fit_one_grpo_step


def test_mixed_advantages_by_hand_and_as_one_group_of_g_plus_one():
    # group 0: samples 0.5, 0.5 and the reference 1.0: mean 2/3, unbiased std sqrt(1/12) -> -0.577, -0.577, 1.155
    rewards, reference = torch.tensor([0.5, 0.5, 0.2, 0.8]), torch.tensor([1.0, 1.0])
    samples, ref = mixed_group_advantages(rewards, reference, 2)
    third = (1 / 6) / math.sqrt(1 / 12)
    assert samples[:2].tolist() == pytest.approx([-third, -third], abs=1e-3)
    assert ref[0].item() == pytest.approx(2 * third, abs=1e-3)
    whole = group_advantages(torch.tensor([0.5, 0.5, 1.0, 0.2, 0.8, 1.0]), 3)
    assert torch.allclose(torch.cat([samples.view(2, 2), ref.view(2, 1)], dim=1).flatten(), whole)


def test_a_group_whose_samples_score_alike_still_has_a_gradient():
    samples, ref = mixed_group_advantages(torch.zeros(4), torch.ones(1), 4)
    assert (samples < 0).all() and ref.item() > 0
    samples, ref = mixed_group_advantages(torch.ones(4), torch.ones(1), 4)  # all as good as the reference: nothing
    assert samples.abs().max().item() == 0.0 and ref.item() == 0.0


def test_shaped_loss_by_hand():
    # token 1: logits (0, 0) -> p 0.5, shaped 0.5 / 0.6; token 2: (ln 3, 0) -> p 0.75, shaped 0.75 / 0.85; token 3 off
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [5.0, -5.0]]], requires_grad=True)  # [1, 3, 2]
    labels = torch.tensor([[0, 0, -100]])  # [1, 3]
    loss = shaped_reference_loss(logits, labels, torch.tensor([2.0]), gamma=0.1)
    assert loss.item() == pytest.approx(-2.0 * (0.5 / 0.6 + 0.75 / 0.85) / 2, abs=1e-6)
    loss.backward()
    # d/dlogit0 of -A/2 * p / (p + g) = -A/2 * g / (p + g)^2 * p (1 - p)
    assert logits.grad[0, 0, 0].item() == pytest.approx(-1.0 * 0.1 / 0.36 * 0.25, abs=1e-6)
    assert torch.equal(logits.grad[0, 2], torch.zeros(2))


def test_shaping_keeps_a_gradient_where_the_policy_finds_the_token_unlikely():
    # at p = 0.01 the ratio p itself gives dp/dlogit = p (1 - p) ~ 0.0099; shaped, gamma / (p + gamma)^2 * p (1 - p)
    logits = torch.tensor([[[math.log(0.01), math.log(0.99)]]], requires_grad=True)
    shaped_reference_loss(logits, torch.tensor([[0]]), torch.tensor([1.0]), gamma=0.1).backward()
    assert -logits.grad[0, 0, 0].item() == pytest.approx(0.1 / 0.11**2 * 0.01 * 0.99, rel=1e-4)
    assert -logits.grad[0, 0, 0].item() > 5 * 0.01 * 0.99


class Exact(RewardFunction):
    """1 for the target itself, else 0: an untrained policy's samples all score 0, so pure GRPO has no gradient."""

    def __call__(self, completions, targets, truncated):
        return [float(c.strip() == t.strip()) for c, t in zip(completions, targets, strict=True)]


@pytest.mark.parametrize("in_group", [False, True])
def test_only_the_reference_moves_the_policy_when_no_sample_earns_anything(make_module, make_datamodule, in_group):
    module = make_module(
        rewards=[Exact()],
        kl={"beta": 0.0},
        reference_in_group={} if in_group else None,
        optimization={"learning_rate": 1e-2},
    )
    before = [p.detach().clone() for p in module.policy.parameters()]
    trainer = fit_one_grpo_step(module, make_datamodule, batch_size=2)

    moved = any(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters(), strict=True))
    assert moved == in_group
    logged = trainer.callback_metrics
    assert ("train/reference_loss" in logged) == in_group
    if in_group:  # every reference beats its samples: a positive advantage, a negative (shaped) loss
        assert logged["train/reference_advantage"].item() > 0 and logged["train/reference_loss"].item() < 0


def test_settings_it_cannot_honour_are_refused_naming_the_key(make_module):
    from interleave_model.settings import ReferenceInGroup

    with pytest.raises(ValueError, match="model.reference_in_group.shaping_gamma must be > 0"):
        ReferenceInGroup(shaping_gamma=0.0)
    with pytest.raises(ValueError, match="model.reference_in_group .*model.loss.scale_rewards"):
        make_module(loss={"scale_rewards": "batch"}, reference_in_group={})


def test_dynamic_sampling_is_refused(make_module):
    with pytest.raises(ValueError, match="model.dynamic_sampling off"):
        make_module(dynamic_sampling={"max_rounds": 1}, reference_in_group={})


def test_a_step_on_a_llama3_folder_learns_its_targets_tokens(family_folders, make_datamodule):
    """Byte-level BPE, a chat template, several stop ids, no pad token, `from_pretrained` from disk: the reference's
    tokens are the tokenized target plus a stop, after the templated prompt."""
    from interleave_model.module import InterleaveGRPO

    module = InterleaveGRPO(
        base={"name_or_path": str(family_folders["llama3"])}, template="compact", sampling={"num_generations": 2},
        kl={"beta": 0.0}, reference_in_group={}, rewards=[Exact()], optimization={"learning_rate": 1e-2},
    )  # fmt: skip
    trainer = fit_one_grpo_step(module, make_datamodule, batch_size=2)
    logged = trainer.callback_metrics
    assert logged["train/reference_advantage"].item() > 0
    assert math.isfinite(logged["train/reference_loss"].item()) and logged["train/reference_loss"].item() < 0


def test_the_reference_term_in_micro_batches_is_the_whole_batch_mean(family_folders, make_datamodule):
    # LUFFY's loss is a mean over the references (rows): one row at a time, each weighted by its share of the rows,
    # gives the loss of both at once (a weighting by target tokens, the cross-entropies', would not: BPE lengths differ)
    from interleave_model.module import InterleaveGRPO

    logged = {}
    for micro in (None, 1):
        module = InterleaveGRPO(
            base={"name_or_path": str(family_folders["llama3"])}, template="compact", sampling={"num_generations": 2},
            kl={"beta": 0.0}, reference_in_group={}, rewards=[Exact()],
            optimization={"micro_batch_size": micro},
        )  # fmt: skip
        metrics = fit_one_grpo_step(module, make_datamodule, batch_size=2).callback_metrics
        logged[micro] = metrics["train/reference_loss"].item(), metrics["train/reference_advantage"].item()
    assert logged[1] == pytest.approx(logged[None], rel=1e-5)
