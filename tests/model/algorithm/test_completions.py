"""Completion log-probs on each real family: the fused LM head where it applies, the logits elsewhere, same values."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from interleave_model.algorithm import completions
from interleave_model.algorithm.completions import completion_logits, completion_logprobs, fused_head, length_buckets
from interleave_model.algorithm.logprobs import token_entropy, token_logprobs
from interleave_model.model.policy import LoraSettings, apply_lora

FUSED = {"llama3": True, "qwen2": True, "gpt2": False}  # GPT-2 is not on the list of plain heads: logits path


def _model(folder, lora: bool):
    """The family's model from disk, seeded; with `lora`, an adapter of random (trained-looking) weights."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder)
    if lora:
        model = apply_lora(model, LoraSettings(r=4, dropout=0.0))
        for p in model.parameters():
            if p.requires_grad:  # a trained adapter, not the zero update of a fresh one
                torch.nn.init.normal_(p, std=0.1)
    return model


def _logprobs_and_grads(model, input_ids, attention_mask, completion, group_size: int):
    """Log-probs, entropies and the trainable weights' gradients of a loss that reaches every completion token."""
    keep = attention_mask[:, -completion.shape[1] :].bool()  # [N, C]
    weights = torch.randn(keep.shape, generator=torch.Generator().manual_seed(1))  # [N, C]
    model.zero_grad()
    logprobs, entropy = completion_logprobs(
        model, input_ids, attention_mask, completion, 0.7, with_entropy=True, group_size=group_size
    )  # [N, C] each
    (logprobs * weights * keep).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return logprobs.detach(), entropy, grads


def _assert_same(values, expected, keep):
    """Log-probs, entropies and gradients equal up to float32 sums in another order."""
    for got, want in zip(values[:2], expected[:2], strict=True):
        torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4)
    grads, expected_grads = values[2], expected[2]
    assert grads.keys() == expected_grads.keys() and expected_grads
    for key, grad in expected_grads.items():  # measured against the gradient's size
        assert (grads[key] - grad).norm() <= 1e-4 * grad.norm(), key


def _decoder_calls(model, monkeypatch) -> list:
    """The input shapes each decoder forward sees from now on."""
    calls = []
    decoder = fused_head(model)[0]
    forward = decoder.forward
    monkeypatch.setattr(decoder, "forward", lambda *a, **k: calls.append(k["input_ids"].shape) or forward(*a, **k))
    return calls


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fused_head_gives_the_logits_path_values(family, lora):
    name, folder = family
    model = _model(folder, lora)
    assert (fused_head(model) is not None) == FUSED[name]
    input_ids = torch.randint(0, 1000, (3, 9))  # [N, Lp+C]
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0  # left padding
    attention_mask[1, -2:] = 0  # a completion that stopped early
    completion = input_ids[:, -4:]  # [N, C]

    logprobs, entropy = completion_logprobs(model, input_ids, attention_mask, completion, 0.7, with_entropy=True)

    logits = completion_logits(model, input_ids, attention_mask, width=4)  # [N, C, V]
    keep = attention_mask[:, -4:].bool()  # [N, C]
    expected = token_logprobs(logits, completion, 0.7)  # [N, C]
    torch.testing.assert_close(logprobs[keep], expected[keep], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(entropy[keep], token_entropy(logits, 0.7)[keep], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_groups_prompt_runs_once_with_the_full_forwards_values_and_gradients(family, lora, monkeypatch):
    name, folder = family
    if not FUSED[name]:
        pytest.skip("the shared prompt is a path of the fused head only")
    model = _model(folder, lora)
    G, P, Lp, C = 3, 2, 6, 5
    prompts = torch.randint(0, 1000, (P, Lp)).repeat_interleave(G, dim=0)  # [N, Lp], G equal rows per group
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[G:, :2] = 0  # the second group's prompt is left-padded
    completion = torch.randint(0, 1000, (P * G, C))  # [N, C]
    completion_mask = torch.ones_like(completion)
    completion_mask[1, -3:] = 0  # completions that stopped early
    completion_mask[4, -1:] = 0
    input_ids, attention_mask = torch.cat([prompts, completion], 1), torch.cat([prompt_mask, completion_mask], 1)
    calls = _decoder_calls(model, monkeypatch)
    full = _logprobs_and_grads(model, input_ids, attention_mask, completion, 1)
    shared = _logprobs_and_grads(model, input_ids, attention_mask, completion, G)

    assert calls == [(P * G, Lp + C), (P, Lp), (P * G, C - 1)]  # the prompts ran once per group
    _assert_same(shared, full, completion_mask.bool())


def test_rows_whose_prompts_differ_within_a_group_take_the_full_forward(family):
    name, folder = family
    if not FUSED[name]:
        pytest.skip("the shared prompt is a path of the fused head only")
    model = AutoModelForCausalLM.from_pretrained(folder)
    input_ids = torch.randint(0, 1000, (4, 9))  # [N, Lp+C]: four different prompts, read as two groups of 2
    attention_mask = torch.ones_like(input_ids)
    completion = input_ids[:, -4:]
    full, _ = completion_logprobs(model, input_ids, attention_mask, completion, 1.0)
    grouped, _ = completion_logprobs(model, input_ids, attention_mask, completion, 1.0, group_size=2)
    torch.testing.assert_close(grouped, full)


def test_columns_past_every_rows_completion_are_cut_before_the_forward(family):
    _, folder = family
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder)
    input_ids = torch.randint(0, 1000, (4, 11))  # [N, Lp+C], C = 6
    attention_mask = torch.ones_like(input_ids)
    attention_mask[:, -2:] = 0  # every row stopped by its 4th completion token: 2 columns no row uses
    attention_mask[1, -3:] = 0
    completion = input_ids[:, -6:]
    keep = attention_mask[:, -6:].bool()
    lengths = []  # the token columns each decoder forward saw (GPT-2's model passes them by position)
    model.get_decoder().register_forward_pre_hook(
        lambda _, args, kwargs: lengths.append(kwargs.get("input_ids", args[0] if args else None).shape[1]),
        with_kwargs=True,
    )
    cut, cut_entropy = completion_logprobs(model, input_ids, attention_mask, completion, 0.7, with_entropy=True)
    assert lengths == [11 - 2]  # the decoder saw the 4 used completion columns, not 6
    # the same rows with the 2 columns used by one row: nothing is cut, and the other rows' values are the same
    whole_mask = attention_mask.clone()
    whole_mask[0, -2:] = 1
    whole, whole_entropy = completion_logprobs(model, input_ids, whole_mask, completion, 0.7, with_entropy=True)
    assert lengths == [9, 11]
    assert cut.shape == cut_entropy.shape == (4, 6)
    assert (cut[:, -2:] == 0).all() and (cut_entropy[:, -2:] == 0).all()
    torch.testing.assert_close(cut[keep], whole[keep], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cut_entropy[keep], whole_entropy[keep], rtol=1e-5, atol=1e-5)


def _padded_cost(lengths, runs, overhead):
    return sum(len(run) * max(lengths[i] for i in run) + overhead for run in runs)


def test_length_buckets_cut_the_sorted_rows_where_padding_costs_most():
    lengths = [8, 96, 71, 16, 53, 96, 96, 96]  # a rollout's group: four rows at the budget, four that stopped
    runs = length_buckets(lengths, overhead=24)
    assert sorted(i for run in runs for i in run) == list(range(8))  # every row once
    assert runs == [[1, 5, 6, 7], [2, 4], [3, 0]]  # longest first; 558 padded tokens + 3 x 24, not 8 x 96 + 24
    assert length_buckets(lengths, overhead=10_000) == [list(range(8))]  # one run keeps the rows' order
    assert length_buckets([5, 5, 5], overhead=0) == [[0, 1, 2]]  # equal lengths: nothing to save by cutting


def test_length_buckets_are_the_cheapest_partition_of_the_sorted_rows():
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 7))]
        overhead = rng.choice([0, 3, 12, 50])
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        best = min(  # every way to cut the sorted rows into runs
            _padded_cost(lengths, [order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)), strict=True)], overhead)
            for k in range(len(order))
            for cuts in itertools.combinations(range(1, len(order)), k)
        )
        assert _padded_cost(lengths, length_buckets(lengths, overhead), overhead) == best


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_completions_of_unequal_length_run_in_sub_batches_with_the_full_forwards_values_and_gradients(
    family, lora, monkeypatch
):
    name, folder = family
    if not FUSED[name]:
        pytest.skip("the shared prompt is a path of the fused head only")
    model = _model(folder, lora)
    G, P, Lp, C = 4, 2, 6, 9
    prompts = torch.randint(0, 1000, (P, Lp)).repeat_interleave(G, dim=0)  # [N, Lp]
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[G:, :2] = 0  # the second group's prompt is left-padded
    completion = torch.randint(0, 1000, (P * G, C))  # [N, C]
    lengths = [9, 2, 9, 1, 3, 9, 2, 8]  # long and short completions mixed within each group
    completion_mask = (torch.arange(C) < torch.tensor(lengths)[:, None]).long()  # [N, C], right-padded
    input_ids, attention_mask = torch.cat([prompts, completion], 1), torch.cat([prompt_mask, completion_mask], 1)
    monkeypatch.setitem(completions.SUB_BATCH_TOKENS, "cpu", 2)
    calls = _decoder_calls(model, monkeypatch)
    full = _logprobs_and_grads(model, input_ids, attention_mask, completion, 1)
    bucketed = _logprobs_and_grads(model, input_ids, attention_mask, completion, G)

    # the full forward; the prompts once; then runs of the longest first, each only as wide as its longest row
    # (a run of 1-token completions needs no forward past the prompt's last position)
    runs = length_buckets(lengths, 2)
    assert len(runs) > 1
    widths = [max(lengths[i] for i in run) - 1 for run in runs]
    assert calls == [(P * G, Lp + C), (P, Lp)] + [(len(r), w) for r, w in zip(runs, widths, strict=True) if w > 0]
    assert sum(len(r) * w for r, w in zip(runs, widths, strict=True)) < P * G * (C - 1)
    _assert_same(bucketed, full, completion_mask.bool())
    assert (bucketed[0][~completion_mask.bool()] == 0).all()
