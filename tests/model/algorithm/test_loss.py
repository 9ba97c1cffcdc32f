"""`GRPOLoss` (`algorithm/loss.py`): the policy term plus beta times the KL term, by hand and against the pure
functions it wires (`grpo.policy_loss`, `kl.kl_loss`), bitwise, in value and gradient."""

import math

import pytest
import torch

from interleave_model.algorithm.grpo import policy_loss
from interleave_model.algorithm.kl import kl_loss
from interleave_model.algorithm.loss import GRPOLoss
from interleave_model.settings.loss import Kl, Loss

# p(token) = [0.5, 0.25], ref(token) = [0.25, 0.5]  ->  log(ref / p) = [-ln2, +ln2]
LOGP = torch.tensor([[math.log(0.5), math.log(0.25)]])
REF = torch.tensor([[math.log(0.25), math.log(0.5)]])
MASK = torch.ones(1, 2)


def test_the_loss_by_hand():
    # first pass (old = logprobs): ratio 1, so each token's policy term is -A = -2, their mean -2;
    # k3 = e^x - x - 1: x = -ln2 -> 0.5 + ln2 - 1, x = ln2 -> 2 - ln2 - 1; their mean (0.5 + 2 - 2) / 2 = 0.25;
    # loss = -2 + 0.1 * 0.25 = -1.975
    terms = GRPOLoss(beta=0.1)(logprobs=LOGP, old_logprobs=LOGP, advantages=torch.tensor([2.0]), mask=MASK,
                               ref_logprobs=REF)  # fmt: skip
    torch.testing.assert_close(terms.loss, torch.tensor(-1.975))
    torch.testing.assert_close(terms.policy.loss, torch.tensor(-2.0))
    torch.testing.assert_close(terms.kl.loss, torch.tensor(0.25))
    torch.testing.assert_close(terms.kl.kl, torch.tensor(0.25))


def test_without_reference_log_probs_there_is_no_kl_term():
    terms = GRPOLoss(beta=0.1)(logprobs=LOGP, old_logprobs=LOGP, advantages=torch.tensor([2.0]), mask=MASK)
    assert terms.kl is None and terms.loss is terms.policy.loss


@pytest.mark.parametrize(
    ("loss_type", "num_tokens", "weighted"),
    [("grpo", None, False), ("dr_grpo", None, True), ("dapo", None, False), ("dapo", 5.0, True)],
)
def test_the_loss_is_the_pure_functions_sum_bitwise(loss_type, num_tokens, weighted):
    """Value and gradient as `policy_loss + beta * kl_loss` with the same aggregation, bit for bit."""
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(4, 6, generator=generator) * 3  # [N, L]
    old, ref = logprobs - 0.3 * torch.randn(4, 6, generator=generator), -torch.rand(4, 6, generator=generator) * 3
    advantages, mask = torch.randn(4, generator=generator), torch.rand(4, 6, generator=generator) > 0.3
    weights = torch.rand(4, 6, generator=generator) if weighted else None
    aggregation = {"loss_type": loss_type, "max_completion_length": 8, "num_tokens": num_tokens}
    loss = GRPOLoss(epsilon=0.2, epsilon_high=0.28, beta=0.04, kl_estimator="k2", loss_type=loss_type,
                    max_completion_length=8)  # fmt: skip

    ours = logprobs.clone().requires_grad_()
    terms = loss(logprobs=ours, old_logprobs=old, advantages=advantages, mask=mask, ref_logprobs=ref,
                 importance_weights=weights, num_tokens=num_tokens)  # fmt: skip
    terms.loss.backward()
    theirs = logprobs.clone().requires_grad_()
    policy = policy_loss(theirs, old, advantages, mask, 0.2, 0.28, importance_weights=weights, **aggregation)
    expected = policy.loss + 0.04 * kl_loss(theirs, ref, mask, "k2", **aggregation).loss
    expected.backward()

    assert torch.equal(terms.loss, expected) and torch.equal(ours.grad, theirs.grad)
    assert torch.equal(terms.policy.clip_frac, policy.clip_frac) and terms.policy.clip_frac > 0


def test_built_from_the_settings():
    loss = GRPOLoss.from_settings(
        Loss(epsilon=0.1, epsilon_high=0.3, loss_type="dr_grpo"), Kl(beta=0.04, estimator="k2"), 64
    )
    assert loss == GRPOLoss(0.1, 0.3, 0.04, "k2", "dr_grpo", 64)


def test_a_micro_batchs_share_of_the_batch():
    # sequence-level normalisers: a chunk of 2 rows of 8 carries 2/8; "dapo" divides by the batch's tokens already
    assert GRPOLoss(loss_type="grpo").share(slice(2, 4), 8) == 0.25
    assert GRPOLoss(loss_type="dr_grpo").share(slice(0, 8), 8) == 1.0
    assert GRPOLoss(loss_type="dapo").share(slice(2, 4), 8) == 1.0
