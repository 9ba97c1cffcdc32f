"""The own sampler's decode step: a plain Llama's, op for op, gives bitwise the tokens, log-probs and logits of the
model's own forward (greedy and sampled, padded prompts, groups, retired rows); every other model steps through its
forward."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch

from interleave_model.generation import rollout
from interleave_model.generation.decode_step import decode_step, llama_step, model_step, plain_llama
from interleave_model.generation.rollout import prefill, sample
from interleave_model.generation.sampling_params import SamplingParams
from interleave_model.model.policy import TinyModelConfig, apply_lora
from interleave_model.model.positions import model_positions
from interleave_model.settings.policy import LoraSettings


@pytest.fixture
def coupled(make_module, make_datamodule):
    """The coupled tiny Llama (2 layers) in eval mode and a held-out batch of 4- and 8-word prompts (left-padded)."""
    shape = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, positions="coupled")
    module = make_module(tiny=shape)
    data = make_datamodule(module.tokenizer)
    batch = data.collate(data.examples(4, "val")[:2] + data.examples(8, "val")[:2], phase="eval")
    assert not bool(batch["prompt_mask"].all()), "the batch must be padded for the mask's path to run"
    return module.policy.eval(), module.tokenizer, batch


def _both(monkeypatch, model, batch, params, pad_token_id):
    """`sample` with the decode step it picks, then with the model's own forward at every step."""
    ids, mask = batch["prompt_ids"], batch["prompt_mask"]
    seeded = torch.Generator().manual_seed(0) if params.temperature else None
    picked = sample(model, ids, mask, params, seeded, pad_token_id=pad_token_id)
    monkeypatch.setattr(rollout, "decode_step", lambda model: partial(model_step, model))
    seeded = torch.Generator().manual_seed(0) if params.temperature else None
    own = sample(model, ids, mask, params, seeded, pad_token_id=pad_token_id)
    monkeypatch.undo()
    return picked, own


def _equal(picked, own) -> None:
    for a, b in zip(picked, own, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_the_tiny_llama_is_stepped_without_its_module_stack(coupled):
    model, _, _ = coupled
    assert plain_llama(model)
    assert decode_step(model).func is llama_step


def test_greedy_answers_and_retired_rows_are_those_of_the_forward(coupled, monkeypatch):
    model, tokenizer, batch = coupled
    params = SamplingParams(num_generations=1, max_new_tokens=24, stop_ids=[tokenizer.eos_token_id], temperature=0.0)
    pad = tokenizer.pad_token_id
    first, *_ = sample(model, batch["prompt_ids"], batch["prompt_mask"], params, pad_token_id=pad)
    # two rows' third tokens made stop tokens: they stop, and are retired at the first look (step 8)
    stops = [tokenizer.eos_token_id, int(first[0, 2]), int(first[1, 2])]
    picked, own = _both(monkeypatch, model, batch, replace(params, stop_ids=stops, with_logprobs=True), pad)
    _equal(picked, own)
    assert not picked[2][:2].any()  # the two rows stopped


def test_sampled_groups_draw_the_tokens_and_log_probs_of_the_forward(coupled, monkeypatch):
    model, tokenizer, batch = coupled
    params = SamplingParams(num_generations=3, max_new_tokens=20, stop_ids=[tokenizer.eos_token_id], with_logprobs=True)
    picked, own = _both(monkeypatch, model, batch, params, tokenizer.pad_token_id)
    _equal(picked, own)
    assert picked[0].shape[0] == 12


def test_each_steps_logits_are_bitwise_the_forwards(coupled):
    model, _, batch = coupled
    ids, mask = batch["prompt_ids"], batch["prompt_mask"]
    positions = model_positions(model, ids, mask)
    length = ids.shape[1]
    attention = torch.cat([mask, mask.new_ones(mask.shape[0], 4)], dim=1).bool()[:, None, None, :]  # [N, 1, 1, L]
    (ours, _, logits), (theirs, _, _) = (prefill(model, ids, mask, positions, length + 4, 1) for _ in range(2))
    position = positions[:, -1:]
    for step in range(4):
        token, position = logits.argmax(-1)[:, None], position + 1
        step_mask = attention[..., : length + step + 1]
        logits = llama_step(model, token, step_mask, position, ours)
        assert torch.equal(logits, model_step(model, token, step_mask, position, theirs))


def test_other_models_step_through_their_forward(coupled):
    model, _, _ = coupled
    model.train()
    assert not plain_llama(model)  # training mode: dropout is the forward's
    model.eval()
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *args: None)
    assert not plain_llama(model)  # a hook would be skipped
    handle.remove()
    projection = model.model.layers[0].mlp.up_proj
    projection.forward = projection.forward  # a forward of its own (the merged copy packs its linear layers so)
    assert not plain_llama(model)
    del projection.forward
    assert plain_llama(model)
    model.config._attn_implementation = "eager"
    assert not plain_llama(model)
    model.config._attn_implementation = "sdpa"
    adapted = apply_lora(model, LoraSettings(r=2)).eval()
    assert not plain_llama(adapted) and decode_step(adapted).func is model_step
