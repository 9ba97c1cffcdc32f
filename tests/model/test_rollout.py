"""The sampler: exact against HF generate, prefix sharing, EOS masks, budgets."""

from __future__ import annotations

import pytest
import torch

from interleave_model.rollout import _mask_through_eos, rollout, sample, token_budget


@pytest.fixture
def tiny(make_module):
    module = make_module()
    prompts = ["A: the first B: a second Interleave:", "A: x B: y z Interleave:"]
    enc = module.tokenizer(prompts, return_tensors="pt", padding=True)
    return module, enc.input_ids, enc.attention_mask


def _sample(module, ids, mask, **kwargs):
    tok = module.tokenizer
    kwargs = {"num_generations": 1, "max_new_tokens": 12, "temperature": 0.0} | kwargs
    return sample(module.policy, ids, mask, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kwargs)


def test_greedy_matches_hf_generate_with_left_padding(tiny):
    module, ids, mask = tiny
    assert mask[1, 0] == 0, "the second prompt must be left-padded for this test to mean anything"
    completion, _, _ = _sample(module, ids, mask)
    reference = module.policy.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
        pad_token_id=module.tokenizer.pad_token_id, eos_token_id=module.tokenizer.eos_token_id,
    )  # fmt: skip
    assert torch.equal(completion, reference[:, ids.shape[1] :][:, : completion.shape[1]])


def test_shared_prefill_gives_each_group_member_the_unshared_answer(tiny):
    module, ids, mask = tiny
    alone, _, _ = _sample(module, ids, mask)
    grouped, _, _ = _sample(module, ids, mask, num_generations=3)
    assert grouped.shape[0] == 6
    for g in range(3):
        assert torch.equal(grouped[g::3], alone)


def test_sampling_is_seeded_and_top_k_1_is_greedy(tiny):
    module, ids, mask = tiny
    draws = [_sample(module, ids, mask, num_generations=4, temperature=1.0, generator=torch.Generator().manual_seed(7))
             for _ in range(2)]  # fmt: skip
    assert torch.equal(draws[0][0], draws[1][0])
    greedy, _, _ = _sample(module, ids, mask)
    top1, _, _ = _sample(module, ids, mask, temperature=1.0, top_k=1)
    assert torch.equal(top1, greedy)


def test_mask_covers_tokens_through_first_eos():
    eos = 9
    ids = torch.tensor([[5, 9, 0, 0], [5, 6, 7, 8], [9, 0, 0, 0]])
    assert _mask_through_eos(ids, eos).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_generation_stops_once_every_row_ended(tiny):
    module, ids, mask = tiny
    eos = module.tokenizer.eos_token_id
    with torch.no_grad():  # make EOS the only possible token: every row ends at the first step
        module.policy.lm_head.weight[eos] += 1000.0
    completion, completion_mask, truncated = _sample(module, ids, mask, max_new_tokens=50)
    assert completion.shape[1] == 1 and completion_mask.sum() == 2 and not truncated.any()


def test_truncated_rows_are_flagged_and_texts_decoded(tiny):
    module, ids, mask = tiny
    out = rollout(module.policy, module.tokenizer, ids, mask, num_generations=2, max_new_tokens=3, temperature=1.0)
    assert out.completion_ids.shape == (4, out.completion_mask.shape[1]) and out.prompt_ids.shape[0] == 4
    ended = (out.completion_ids == module.tokenizer.eos_token_id).any(-1)
    assert torch.equal(out.truncated, ~ended)
    assert all(isinstance(t, str) and "<pad>" not in t for t in out.texts)


def test_budget_holds_the_longest_target_with_margin():
    # longest target 20 tokens: ceil(20 * 1.25) = 25, + 1 EOS + 4 slack = 30
    assert token_budget([12, 20, 7], margin=0.25, slack=4) == 30
    assert token_budget([1000]) > 2 * token_budget([400])
