"""The KL term (`algorithm/kl.py`): the estimators by hand, their expected gradients, and the term's aggregation
beside the policy loss (TRL adds it to each token before aggregating: the same loss)."""

import math

import pytest
import torch

from interleave_model.algorithm.grpo import aggregate, policy_loss
from interleave_model.algorithm.kl import kl_divergence, kl_loss

LN2 = math.log(2)

# p(token) = [0.5, 0.25], ref(token) = [0.25, 0.5]  ->  log_ratio = log(ref/p) = [-ln2, +ln2]
LOGP = torch.tensor([[math.log(0.5), math.log(0.25)]])
REF = torch.tensor([[math.log(0.25), math.log(0.5)]])


def test_kl_k1():
    # k1 = logp - logr = [ln2, -ln2] = [0.6931, -0.6931]
    torch.testing.assert_close(kl_divergence(LOGP, REF, "k1"), torch.tensor([[LN2, -LN2]]))


def test_kl_k2():
    # k2 = 0.5 * (ln2)^2 = 0.2402 at both tokens
    torch.testing.assert_close(kl_divergence(LOGP, REF, "k2"), torch.tensor([[0.5 * LN2**2, 0.5 * LN2**2]]))


def test_kl_k3():
    # k3 = e^x - x - 1: x = -ln2 -> 0.5 + 0.6931 - 1 = 0.1931; x = ln2 -> 2 - 0.6931 - 1 = 0.3069
    torch.testing.assert_close(kl_divergence(LOGP, REF, "k3"), torch.tensor([[LN2 - 0.5, 1 - LN2]]))


def test_k1_and_k3_are_unbiased_and_k3_nonnegative():
    # p = [0.7, 0.3], q = [0.4, 0.6]: KL(p||q) = 0.7 ln(7/4) + 0.3 ln(1/2) = 0.39173 - 0.20794 = 0.18379
    # the p-weighted mean over the support is the exact expectation under sampling from p
    p, q = torch.tensor([[0.7, 0.3]]), torch.tensor([[0.4, 0.6]])
    kl = 0.7 * math.log(7 / 4) + 0.3 * math.log(0.5)
    for estimator in ("k1", "k3"):
        expectation = (p * kl_divergence(p.log(), q.log(), estimator)).sum()
        torch.testing.assert_close(expectation, torch.tensor(kl))
    a, b = torch.randn(2, 50, generator=torch.Generator().manual_seed(0)) * 3
    assert (kl_divergence(a[None], b[None], "k3") >= 0).all()


def _expected_kl_gradient(estimator: str, p: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Exact E_{x ~ p}[grad_logits k(x)]: every token of the vocabulary weighted by its (detached) probability."""
    logits = p.log().requires_grad_()
    logprobs = torch.log_softmax(logits, dim=-1)  # [1, V]
    (p * kl_divergence(logprobs, ref.log(), estimator)).sum().backward()
    return logits.grad


def test_k1_has_zero_expected_gradient_unlike_k2_and_k3():
    # p = [0.5, 0.25, 0.25], ref = [0.25, 0.25, 0.5]; d log p_x / d z_j = 1[x == j] - p_j
    # k1 = log p - log ref: sum_x p_x (1[x == j] - p_j) = p_j - p_j = 0 -> [0, 0, 0]
    # k3 = r - log r - 1 with r = ref / p, d k3 / d log p = 1 - r:
    #   sum_x p_x (1 - r_x)(1[x == j] - p_j) = p_j (1 - r_j) - p_j (1 - sum ref) = p_j - ref_j = [0.25, 0, -0.25]
    # k2 = 0.5 log(ref/p)^2, d k2 / d log p = log(p/ref): p_j log(p_j/ref_j) - p_j KL = grad KL(p || ref)
    #   KL = 0.5 ln2 + 0 + 0.25 ln(1/2) = 0.25 ln2 -> [0.5 (ln2 - 0.25 ln2), -0.25 * 0.25 ln2, 0.25 (-ln2 - 0.25 ln2)]
    #   = ln2 * [0.375, -0.0625, -0.3125]
    p, ref = torch.tensor([[0.5, 0.25, 0.25]]), torch.tensor([[0.25, 0.25, 0.5]])
    torch.testing.assert_close(_expected_kl_gradient("k1", p, ref), torch.zeros(1, 3))
    torch.testing.assert_close(_expected_kl_gradient("k3", p, ref), torch.tensor([[0.25, 0.0, -0.25]]))
    torch.testing.assert_close(_expected_kl_gradient("k2", p, ref), LN2 * torch.tensor([[0.375, -0.0625, -0.3125]]))


def test_kl_rejects_unknown_estimator():
    with pytest.raises(ValueError, match="k4"):
        kl_divergence(LOGP, REF, "k4")


def test_the_term_is_the_estimate_aggregated_and_its_mean():
    # one counted token: p = 0.5, ref = 0.25; the second token is masked garbage
    # k3 at x = ln(0.25/0.5) = -ln2: 0.5 + ln2 - 1 = 0.19315; k1: ln2 = 0.69315
    logprobs = torch.tensor([[math.log(0.5), 0.0]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), 50.0]])
    mask = torch.tensor([[1, 0]])
    out = kl_loss(logprobs, ref, mask, "k3")
    torch.testing.assert_close(out.loss, torch.tensor(LN2 - 0.5))
    torch.testing.assert_close(out.kl, torch.tensor(LN2 - 0.5))
    assert not out.kl.requires_grad
    out.loss.backward()
    # d k3 / d logp = 1 - ref / p = 1 - 0.5 = 0.5 at the counted token, 0 at the masked one
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.5, 0.0]]))
    torch.testing.assert_close(kl_loss(logprobs, ref, mask, "k1").loss, torch.tensor(LN2))


@pytest.mark.parametrize(("loss_type", "max_completion_length"), [("grpo", None), ("dr_grpo", 5), ("dapo", None)])
def test_policy_loss_plus_beta_kl_is_trls_per_token_sum(loss_type, max_completion_length):
    # TRL: aggregate(pg_per_token + beta * kl_per_token); here the two are aggregated apart and summed. Rows of
    # different lengths, so "grpo"'s per-row means and "dapo"'s token mean weigh tokens differently
    g = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(3, 4, generator=g) * 2).requires_grad_()
    old, ref = -torch.rand(3, 4, generator=g) * 2, -torch.rand(3, 4, generator=g) * 2
    advantages, mask = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    beta, how = 0.3, {"loss_type": loss_type, "max_completion_length": max_completion_length}
    ours = policy_loss(logprobs, old, advantages, mask, **how).loss + beta * kl_loss(logprobs, ref, mask, **how).loss
    ratio = (logprobs - old).exp()
    pg = -torch.minimum(ratio * advantages[:, None], ratio.clamp(0.8, 1.2) * advantages[:, None])
    trl = aggregate(pg + beta * kl_divergence(logprobs, ref, "k3"), mask, **how)
    torch.testing.assert_close(ours, trl)
    grads = [torch.autograd.grad(loss, logprobs, retain_graph=True)[0] for loss in (ours, trl)]
    torch.testing.assert_close(*grads)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_an_empty_row_and_garbage_give_a_finite_term(loss_type):
    logprobs = torch.tensor([[-1.0, -1.0], [float("nan"), float("inf")]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0], [float("inf"), float("-inf")]])
    mask = torch.tensor([[True, True], [False, False]])
    out = kl_loss(logprobs, ref, mask, loss_type=loss_type, max_completion_length=2)
    assert out.loss == 0 and out.kl == 0  # ref == policy on the counted tokens
    out.loss.backward()
    assert torch.isfinite(logprobs.grad).all()
