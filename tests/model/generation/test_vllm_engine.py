"""The vLLM engine against the own sampler: same tokens, stops, texts and log-probs, before and after weight syncs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from interleave_model.algorithm.completions import completion_logprobs  # noqa: E402
from interleave_model.generation.rollout import rollout  # noqa: E402
from interleave_model.generation.sampling_params import SamplingParams  # noqa: E402
from interleave_model.generation.vllm_engine import VllmEngine, VllmSettings  # noqa: E402
from interleave_model.model.policy import LoraSettings, apply_lora, load_pretrained, stop_token_ids  # noqa: E402

SETTINGS = VllmSettings(kv_cache_memory_bytes=32 << 20, max_model_len=512, enforce_eager=True)
PROMPTS = ["Fragment A: the quick brown fox. Fragment B: over the lazy dog.", "A: jumps B: over"]


@pytest.fixture(scope="module")
def soft_folders(family_folders, tmp_path_factory):
    """The family folders with embeddings scaled down: the fixtures' sharp logits make every answer one token repeated
    at log-prob 0, where neither the log-prob check nor a weight sync could show a difference."""
    root = tmp_path_factory.mktemp("soft")
    folders = {}
    for name in ("llama3", "qwen2"):
        model, tokenizer = load_pretrained(str(family_folders[name]), dtype="float32")
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(0.1)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        folders[name] = str(root / name)
    return folders


def _policy(folder: str):
    model, tokenizer = load_pretrained(folder, dtype="float32")
    return model, tokenizer, stop_token_ids(model, tokenizer)


def _prompts(tokenizer):
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    return enc.input_ids, enc.attention_mask


def _both(engine, model, tokenizer, stops, ids, mask, **settings):
    greedy = {"num_generations": 2, "max_new_tokens": 12, "stop_ids": stops, "temperature": 0.0}
    params = SamplingParams(**greedy | settings)
    return engine.rollout(ids, mask, params), rollout(model, tokenizer, ids, mask, params)


@pytest.fixture(scope="module", params=["llama3", "qwen2", "gpt2"])
def family_engine(request, family_folders):
    """One engine per family, over the fixture folder as it is (fp32).

    The random models rarely end an answer, so the first prompt's first greedy token joins the family's stop ids:
    one group stops, the other runs out of budget.
    """
    model, tokenizer, stops = _policy(str(family_folders[request.param]))
    ids, mask = _prompts(tokenizer)
    params = SamplingParams(num_generations=1, max_new_tokens=12, stop_ids=stops, temperature=0.0)
    first = rollout(model, tokenizer, ids, mask, params)
    assert first.completion_ids[0, 0] not in first.completion_ids[1], "pick prompts whose answers differ"
    stops = [*stops, int(first.completion_ids[0, 0])]
    engine = VllmEngine(model, tokenizer, str(family_folders[request.param]), SETTINGS)
    yield request.param, engine, model, tokenizer, stops
    engine.close()


def test_greedy_tokens_stops_truncation_and_texts_equal_the_own_sampler(family_engine):
    name, engine, model, tokenizer, stops = family_engine
    ids, mask = _prompts(tokenizer)
    ours, theirs = _both(engine, model, tokenizer, stops, ids, mask)
    assert torch.equal(ours.completion_ids, theirs.completion_ids), name
    assert torch.equal(ours.completion_mask, theirs.completion_mask)
    assert ours.truncated.tolist() == theirs.truncated.tolist() == [False, False, True, True]  # a stop, a budget
    assert ours.texts == theirs.texts
    assert torch.equal(ours.prompt_ids, theirs.prompt_ids)


@pytest.fixture(scope="module")
def full_engine(soft_folders):
    """An engine on the softened Llama-3 folder, its trainer's policy trained in full."""
    model, tokenizer, stops = _policy(soft_folders["llama3"])
    engine = VllmEngine(model, tokenizer, soft_folders["llama3"], SETTINGS)
    engine.serve(model, version=0)
    yield engine, model, tokenizer, stops
    engine.close()


def test_sampled_logprobs_equal_the_trainers(full_engine):
    engine, model, tokenizer, stops = full_engine
    ids, mask = _prompts(tokenizer)
    params = SamplingParams(num_generations=4, max_new_tokens=16, stop_ids=stops, temperature=0.9)
    out = engine.rollout(ids, mask, params, torch.Generator().manual_seed(0))
    input_ids = torch.cat([out.prompt_ids, out.completion_ids], dim=1)
    attention = torch.cat([out.prompt_mask, out.completion_mask], dim=1)
    trainer, _ = completion_logprobs(model, input_ids, attention, out.completion_ids, 0.9)
    gap = ((trainer - out.logprobs) * out.completion_mask).abs().max()
    assert gap < 1e-4 and out.logprobs[out.completion_mask.bool()].min() < -0.1  # informative log-probs
    assert len(set(map(tuple, out.completion_ids.tolist()))) > 2  # sampled, not one answer repeated


def _train(model, tokenizer, steps: int = 3) -> None:
    """A few optimizer steps of plain next-token loss: enough to change the greedy answers."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    batch = tokenizer(["the lazy dog jumps over the quick brown fox"] * 2, return_tensors="pt")
    for _ in range(steps):
        optimizer.zero_grad()
        model(**batch, labels=batch.input_ids).loss.backward()
        optimizer.step()


def test_full_weights_sync_after_optimizer_steps(full_engine):
    engine, model, tokenizer, stops = full_engine
    ids, mask = _prompts(tokenizer)
    before, _ = _both(engine, model, tokenizer, stops, ids, mask, max_new_tokens=8)
    _train(model, tokenizer)
    stale, trained = _both(engine, model, tokenizer, stops, ids, mask, max_new_tokens=8)
    assert torch.equal(stale.completion_ids, before.completion_ids)  # no sync yet: the old policy
    assert not torch.equal(trained.completion_ids, before.completion_ids)  # the training changed the answers
    engine.serve(model, version=1)
    synced, trained = _both(engine, model, tokenizer, stops, ids, mask, max_new_tokens=8)
    assert torch.equal(synced.completion_ids, trained.completion_ids)


def test_lora_sync_serves_the_adapter_and_leaves_the_base_bitwise(soft_folders):
    model, tokenizer, stops = _policy(soft_folders["qwen2"])
    model = apply_lora(model, LoraSettings(r=8, alpha=16, dropout=0.0))
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    engine = VllmEngine(model, tokenizer, soft_folders["qwen2"], SETTINGS)
    try:
        ids, mask = _prompts(tokenizer)
        engine.serve(model, version=0)
        before, _ = _both(engine, model, tokenizer, stops, ids, mask, max_new_tokens=8)
        _train(model, tokenizer)
        for version in range(1, 51):
            engine.serve(model, version=version)
        synced, trained = _both(engine, model, tokenizer, stops, ids, mask, max_new_tokens=8)
        assert not torch.equal(trained.completion_ids, before.completion_ids)
        assert torch.equal(synced.completion_ids, trained.completion_ids)
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in base.items())
    finally:
        engine.close()
