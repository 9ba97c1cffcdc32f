"""Hand-checked tests of the GRPO math: the arithmetic behind every expected value is written next to it."""

import math

import pytest
import torch
import torch.nn.functional as F

from interleave_model.algorithm.grpo import (
    group_advantages,
    masked_mean,
    policy_loss,
    sft_loss,
    zero_std_groups,
)
from interleave_model.algorithm.logprobs import token_entropy, token_logprobs

LN2 = math.log(2)

# Two groups of G=4: group 0 is [1, 0, 0, 1] (mean 0.5), group 1 all 0.5 (zero variance).
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])


# ---- advantages ---------------------------------------------------------------------------------------------------


def test_advantages_none_is_reward_minus_group_mean():
    # group 0: r - 0.5 = [0.5, -0.5, -0.5, 0.5]; group 1: 0.5 - 0.5 = 0
    adv = group_advantages(REWARDS, num_generations=4, scale_rewards="none")
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))


def test_advantages_group_scaling_uses_unbiased_std():
    # group 0: squared deviations 4 * 0.25 = 1, unbiased var = 1 / (4 - 1) = 1/3, std = 1/sqrt(3)
    # 0.5 / (1/sqrt(3)) = sqrt(3)/2 = 0.8660; with eps=1e-4: 0.5 / (0.57735 + 0.0001) = 0.86588
    # group 1: std 0 and eps 0 would be 0/0, but a zero-variance group is exactly 0 (no NaN)
    half_root3 = math.sqrt(3) / 2
    adv = group_advantages(REWARDS, num_generations=4, scale_rewards="group", eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([half_root3, -half_root3, -half_root3, half_root3, 0, 0, 0, 0]))
    adv = group_advantages(REWARDS, num_generations=4)
    expected = 0.5 / (1 / math.sqrt(3) + 1e-4)
    torch.testing.assert_close(adv[:4], torch.tensor([expected, -expected, -expected, expected]))


def test_advantages_batch_scaling_uses_std_of_whole_batch():
    # batch mean 0.5; squared deviations 4 * 0.25 + 4 * 0 = 1; unbiased var = 1 / (8 - 1) = 1/7
    # 0.5 / (1/sqrt(7)) = sqrt(7)/2 = 1.3229
    half_root7 = math.sqrt(7) / 2
    adv = group_advantages(REWARDS, num_generations=4, scale_rewards="batch", eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([half_root7, -half_root7, -half_root7, half_root7, 0, 0, 0, 0]))


def test_advantages_batch_scaling_takes_the_std_of_all_ranks():
    # a second rank holding the same rewards: mean 0.5, squared deviations 2 * 1 = 2 over 16 rewards, unbiased
    # var 2/15; 0.5 / sqrt(2/15) = 1.3693 (one rank: sqrt(7)/2 = 1.3229); group 1 stays exactly 0
    two_ranks = lambda x: 2 * x  # noqa: E731
    adv = group_advantages(REWARDS, num_generations=4, scale_rewards="batch", eps=0.0, sum_over_ranks=two_ranks)
    a = 0.5 / math.sqrt(2 / 15)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a, 0, 0, 0, 0]))


def test_rloo_leaves_each_completion_out_of_its_baseline():
    # [1, 0, 0]: baselines (0+0)/2 = 0, (1+0)/2 = 0.5, 0.5 -> [1, -0.5, -0.5]
    # check: G/(G-1) * (r - mean) = 3/2 * [2/3, -1/3, -1/3] = [1, -0.5, -0.5]
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, num_generations=3, scale_rewards="none", estimator="rloo")
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, -0.5, 0, 0, 0]))
    # group std: mean 1/3, squared deviations 4/9 + 1/9 + 1/9 = 2/3, unbiased var 1/3, std 1/sqrt(3)
    # [1, -0.5, -0.5] * sqrt(3) = [1.7321, -0.8660, -0.8660]
    adv = group_advantages(rewards, num_generations=3, scale_rewards="group", estimator="rloo", eps=0.0)
    r3 = math.sqrt(3)
    torch.testing.assert_close(adv, torch.tensor([r3, -r3 / 2, -r3 / 2, 0, 0, 0]))


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_zero_variance_group_gives_exact_zero(scale_rewards, estimator):
    # in float32, r - mean(r) is 6e-8 for [0.9] * 3 and 7e-9 for [0.1] * 16, so naively 6e-8 / (0 + 1e-4) = 6e-4
    for value, g in [(0.9, 3), (0.1, 16)]:
        rewards = torch.cat([torch.full((g,), value), torch.arange(g, dtype=torch.float32)])
        adv = group_advantages(rewards, num_generations=g, scale_rewards=scale_rewards, estimator=estimator)
        assert torch.equal(adv[:g], torch.zeros(g))
        assert adv[g:].any()


def test_zero_std_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.3, 0.3])
    assert zero_std_groups(rewards, num_generations=2).tolist() == [True, False, True]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_generations": 1},
        {"num_generations": 3},
        {"num_generations": 4, "scale_rewards": "std"},
        {"num_generations": 4, "estimator": "ppo"},
        {"num_generations": 4, "eps": -1.0},
    ],
)
def test_advantages_reject_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        group_advantages(REWARDS, **kwargs)


def test_advantages_reject_2d_rewards():
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(REWARDS.view(2, 4), num_generations=4)


# ---- clipping -----------------------------------------------------------------------------------------------------


def test_clipping_both_signs_above_and_below_the_band():
    # epsilon 0.2: band [0.8, 1.2]; one token per sequence, old log-prob 0 so ratio = exp(logprob)
    #   ratio 1.5, A=+1: -min(1.5, 1.2) = -1.2   clipped (gradient 0)
    #   ratio 1.5, A=-1: -min(-1.5, -1.2) = 1.5  unclipped (pessimistic side)
    #   ratio 0.5, A=+1: -min(0.5, 0.8) = -0.5   unclipped
    #   ratio 0.5, A=-1: -min(-0.5, -0.8) = 0.8  clipped
    # loss = (-1.2 + 1.5 - 0.5 + 0.8) / 4 = 0.15; clip_frac = 2/4; ratio_mean = (1.5 + 1.5 + 0.5 + 0.5) / 4 = 1
    # d loss / d logprob = -ratio * A / 4 where unclipped: [0, 1.5/4, -0.5/4, 0] = [0, 0.375, -0.125, 0]
    logprobs = torch.tensor([[1.5], [1.5], [0.5], [0.5]]).log().requires_grad_()
    out = policy_loss(logprobs, torch.zeros(4, 1), torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.ones(4, 1))
    torch.testing.assert_close(out.loss, torch.tensor(0.15))
    torch.testing.assert_close(out.clip_frac, torch.tensor(0.5))
    torch.testing.assert_close(out.ratio_mean, torch.tensor(1.0))
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0], [0.375], [-0.125], [0.0]]))
    assert not any(t.requires_grad for t in out[1:])


def test_clip_higher_widens_only_the_upper_bound():
    # ratio 1.25 with A=+1, ratio 0.75 with A=-1
    # epsilon 0.2 both ways: [-min(1.25, 1.2), -min(-0.75, -0.8)] = [-1.2, 0.8] -> mean -0.2, both clipped
    # epsilon_high 0.28: band [0.8, 1.28]: [-1.25, 0.8] -> mean -0.225, only the second clipped
    logprobs = torch.tensor([[1.25], [0.75]]).log()
    args = (logprobs, torch.zeros(2, 1), torch.tensor([1.0, -1.0]), torch.ones(2, 1))
    symmetric = policy_loss(*args, epsilon=0.2)
    torch.testing.assert_close(symmetric.loss, torch.tensor(-0.2))
    torch.testing.assert_close(symmetric.clip_frac, torch.tensor(1.0))
    asymmetric = policy_loss(*args, epsilon=0.2, epsilon_high=0.28)
    torch.testing.assert_close(asymmetric.loss, torch.tensor(-0.225))
    torch.testing.assert_close(asymmetric.clip_frac, torch.tensor(0.5))


# ---- loss aggregation ---------------------------------------------------------------------------------------------

# 2 sequences x 3 tokens, mask [[1, 1, 0], [1, 0, 0]], ratio 1 everywhere it counts, A = [1, -3]:
# per-token loss -A: row 0 = [-1, -1, .], row 1 = [3, ., .]; masked cells hold garbage that must not leak.
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
OLD = torch.tensor([[-1.0, -2.0, -1e4], [-0.5, float("nan"), -1e4]])
LOGPROBS = torch.tensor([[-1.0, -2.0, 1e4], [-0.5, float("inf"), 1e4]])
ADV = torch.tensor([1.0, -3.0])


@pytest.mark.parametrize(
    ("loss_type", "max_completion_length", "expected"),
    [
        ("grpo", None, 1.0),  # sequence means [-2/2, 3/1] = [-1, 3], mean over sequences (-1 + 3) / 2 = 1
        ("dr_grpo", 3, 1 / 6),  # sum (-1 - 1 + 3) = 1 over N * max_completion_length = 2 * 3 = 6
        ("dr_grpo", 4, 1 / 8),  # 1 over 2 * 4 = 8: the constant, not the batch's width L = 3
        ("dapo", None, 1 / 3),  # sum 1 over 3 completion tokens
    ],
)
def test_loss_types(loss_type, max_completion_length, expected):
    logprobs = LOGPROBS.clone().requires_grad_()
    out = policy_loss(logprobs, OLD, ADV, MASK, loss_type=loss_type, max_completion_length=max_completion_length)
    torch.testing.assert_close(out.loss, torch.tensor(expected))
    torch.testing.assert_close(out.ratio_mean, torch.tensor(1.0))
    out.loss.backward()
    assert torch.isfinite(logprobs.grad).all()
    assert (logprobs.grad[MASK == 0] == 0).all()


def test_dapo_divides_by_the_token_count_it_is_given():
    # the same per-token sum 1 (as above) over the 8 tokens of every rank / 2 ranks = 4 -> 1/4, not 1/3
    out = policy_loss(LOGPROBS, OLD, ADV, MASK, loss_type="dapo", num_tokens=4.0)
    torch.testing.assert_close(out.loss, torch.tensor(0.25))


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_empty_mask_row_gives_finite_loss_and_gradient(loss_type):
    # row 1 has no completion token and garbage everywhere; row 0: ratio 1, A = 2 -> per-token -2
    logprobs = torch.tensor([[-1.0, -1.0], [float("nan"), float("inf")]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0], [float("-inf"), float("nan")]])
    mask = torch.tensor([[True, True], [False, False]])
    out = policy_loss(logprobs, old, torch.tensor([2.0, 0.0]), mask, loss_type=loss_type, max_completion_length=2)
    assert all(torch.isfinite(t) for t in out)
    out.loss.backward()
    assert torch.isfinite(logprobs.grad).all()
    # grpo: (-2 + 0) / 2 = -1 (the empty row counts as a sequence); dr_grpo: -4 / (2 * 2) = -1; dapo: -4 / 2 = -2
    expected = {"grpo": -1.0, "dr_grpo": -1.0, "dapo": -2.0}[loss_type]
    torch.testing.assert_close(out.loss, torch.tensor(expected))


def test_all_masked_batch_gives_zero_loss():
    out = policy_loss(torch.zeros(2, 3, requires_grad=True), torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3))
    assert out.loss == 0 and out.clip_frac == 0 and out.ratio_mean == 0
    out.loss.backward()


def test_first_pass_ratio_is_one_but_gradient_is_the_policy_gradient():
    # old = logprobs.detach(): ratio 1 (never clipped), d loss / d logprob = -A / L for grpo with one row
    logprobs = torch.tensor([[-0.3, -1.2]], requires_grad=True)
    out = policy_loss(logprobs, logprobs.detach(), torch.tensor([0.5]), torch.ones(1, 2))
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.25, -0.25]]))
    assert out.clip_frac == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"loss_type": "bnpo"},
        {"epsilon": -0.1},
        {"max_completion_length": 0},
        {"loss_type": "dr_grpo"},  # no constant: the batch's width would be the only length left
        {"loss_type": "dapo", "num_tokens": 0.0},
    ],
)
def test_policy_loss_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        policy_loss(LOGPROBS, OLD, ADV, MASK, **kwargs)


def test_policy_loss_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(LOGPROBS, OLD, torch.ones(3), MASK)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(LOGPROBS, OLD, ADV, MASK[:, :2])


def test_masked_mean():
    # (1 + 3) / 2 = 2 over everything; per row [1, 3] and an empty row gives 0, not NaN
    x = torch.tensor([[1.0, float("nan")], [3.0, 5.0], [7.0, 9.0]])
    mask = torch.tensor([[1, 0], [1, 0], [0, 0]])
    torch.testing.assert_close(masked_mean(x, mask), torch.tensor(2.0))
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.0, 3.0, 0.0]))


# ---- token log-probs, entropy, SFT --------------------------------------------------------------------------------


def _random_logits(*shape, dtype=torch.float32, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 4).to(dtype)


@pytest.mark.parametrize("chunk_size", [None, 1, 2, 4, 12])  # 4 < L splits rows; 12 takes two rows at a time
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_log_softmax(chunk_size, dtype, temperature):
    logits = _random_logits(3, 6, 11, dtype=dtype)[:, :5]  # a non-contiguous view, as logits[:, :-1] is
    tokens = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(1))
    expected = torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    got = token_logprobs(logits, tokens, temperature, chunk_size=chunk_size)
    assert got.dtype == torch.float32 and got.shape == (3, 5)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("chunk_size", [None, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_gradient_matches_log_softmax(chunk_size, dtype):
    tokens = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(3, 5, generator=torch.Generator().manual_seed(2))
    grads = []
    for fn in (
        lambda x: torch.log_softmax(x.float() / 0.7, dim=-1).gather(-1, tokens[..., None]).squeeze(-1),
        lambda x: token_logprobs(x, tokens, 0.7, chunk_size=chunk_size),
    ):
        logits = _random_logits(3, 5, 11, dtype=dtype).requires_grad_()
        (fn(logits) * weights).sum().backward()
        assert logits.grad.dtype == dtype
        grads.append(logits.grad.float())
    torch.testing.assert_close(grads[1], grads[0], atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)


def test_token_logprobs_gradcheck():
    logits = _random_logits(2, 3, 5, dtype=torch.float64).requires_grad_()
    tokens = torch.tensor([[0, 4, 2], [1, 1, 3]])
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, tokens, 0.5, chunk_size=2), (logits,))


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_token_entropy_matches_direct_formula(chunk_size):
    # H = -sum_v p_v log p_v; a uniform row over V = 11 has H = ln 11; a -inf logit contributes 0, not NaN
    logits = _random_logits(3, 5, 11, dtype=torch.bfloat16)
    logp = torch.log_softmax(logits.float() / 0.7, dim=-1)
    expected = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(token_entropy(logits, 0.7, chunk_size=chunk_size), expected)
    uniform = torch.zeros(1, 1, 11)
    torch.testing.assert_close(token_entropy(uniform), torch.tensor([[math.log(11)]]))
    masked = torch.tensor([[[0.0, 0.0, float("-inf")]]])
    torch.testing.assert_close(token_entropy(masked), torch.tensor([[LN2]]))


def test_sft_loss_matches_cross_entropy():
    logits = _random_logits(2, 4, 7).requires_grad_()
    labels = torch.tensor([[-100, 3, 6, -100], [0, 2, -100, 5]])
    expected = F.cross_entropy(logits.reshape(-1, 7), labels.reshape(-1), ignore_index=-100)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    got = sft_loss(logits, labels)
    torch.testing.assert_close(got, expected)
    got.backward()
    torch.testing.assert_close(logits.grad, expected_grad)


def test_sft_loss_with_nothing_to_learn_is_zero():
    logits = _random_logits(1, 2, 7).requires_grad_()
    loss = sft_loss(logits, torch.full((1, 2), -100))
    assert loss == 0
    loss.backward()
    assert (logits.grad == 0).all()
