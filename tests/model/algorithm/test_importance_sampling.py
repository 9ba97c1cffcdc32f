"""Truncated importance sampling for rollouts from another engine: the weights and where they enter the loss."""

from __future__ import annotations

import math

import torch

from interleave_model.algorithm.grpo import policy_loss, truncated_importance_weights


def test_weights_are_the_trainer_over_engine_ratio_capped():
    trainer = torch.tensor([[0.0, -1.0, -2.0]])
    engine = torch.tensor([[-math.log(2.0), 0.0, -2.0]])
    # exp(0 + ln 2) = 2 -> capped at 1.5; exp(-1 - 0) = 0.368; exp(0) = 1
    weights = truncated_importance_weights(trainer, engine, cap=1.5)
    assert torch.allclose(weights, torch.tensor([[1.5, math.exp(-1.0), 1.0]]))


def test_weights_scale_each_tokens_policy_term():
    logprobs = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    mask = torch.ones(1, 2)
    weights = torch.tensor([[2.0, 0.5]])
    plain = policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), mask)
    weighted = policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), mask, importance_weights=weights)
    # ratio 1, A = 1: the policy term is -1 per token, -w with the weights; mean over the row: -(2 + 0.5) / 2 = -1.25
    assert math.isclose(plain.loss.item(), -1.0) and math.isclose(weighted.loss.item(), -1.25)
    # the KL term (`algorithm/kl.py`) takes no weights: the engine's correction is the policy term's alone
