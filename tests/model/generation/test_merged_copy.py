"""The merged copy the training rollout may sample from: the policy's distribution, its weights kept up to date, its
one-query attention equal to SDPA's, and its samples' log-probs recorded and corrected in the update."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from interleave_model.algorithm.completions import completion_logprobs
from interleave_model.generation.merged_copy import MergedCopy, PackedLinear, fastest_copy, grouped_decode_attention
from interleave_model.generation.rollout import sample
from interleave_model.generation.rollout_cache import SharedPrefix
from interleave_model.generation.sampler import AUTO_PROBE_DRAWS
from interleave_model.generation.sampling_params import SamplingParams
from interleave_model.model.policy import apply_lora, load_pretrained, stop_token_ids
from interleave_model.runtime import compat
from interleave_model.settings import SettingsError
from interleave_model.settings.policy import LoraSettings
from interleave_model.settings.sampling import Sampling


@pytest.fixture(params=["llama3", "qwen2", "gpt2"])
def lora_policy(request, family_folders):
    """A real-family folder loaded from disk (GQA in the Llama-3 one, Conv1D layers in GPT-2's) with a LoRA adapter
    whose B is not zero (as after training)."""
    return _lora_policy(family_folders[request.param])


@pytest.fixture
def llama_policy(family_folders):
    """`lora_policy` of the Llama-3 folder only: for what does not depend on the family."""
    return _lora_policy(family_folders["llama3"])


def _lora_policy(folder):
    model, tok = load_pretrained(str(folder), dtype="float32")
    with torch.no_grad():  # the fixtures' random logits are peaked (log-probs 0.0): spread them to be sampled
        final_norm = model.transformer.ln_f if hasattr(model, "transformer") else model.model.norm  # GPT-2 / others
        final_norm.weight.mul_(0.05)
    policy = apply_lora(model, LoraSettings(r=4, alpha=8, dropout=0.0)).eval()  # GPT-2 has dropout layers
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.05)
    prompts = tok(["the cat sat on", "a"], return_tensors="pt", padding=True, padding_side="left")
    return policy, tok, prompts


def _prompt_logprobs(model, prompts) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=prompts.input_ids, attention_mask=prompts.attention_mask).logits.float()
    return logits.log_softmax(-1)[prompts.attention_mask.bool()]  # [real tokens, V]


def test_a_float32_copy_is_the_policy_and_follows_its_updates(lora_policy):
    policy, tok, prompts = lora_policy
    copy = MergedCopy(policy, "float32")
    model = copy.refresh(version=0)
    assert not any("lora_" in name for name, _ in model.named_parameters())  # merged: a plain model
    torch.testing.assert_close(_prompt_logprobs(model, prompts), _prompt_logprobs(policy, prompts), atol=1e-4, rtol=0)
    base = {name: p.clone() for name, p in policy.named_parameters() if "lora_" not in name}
    with torch.no_grad():  # an update moves the adapter
        for name, parameter in policy.named_parameters():
            if "lora_A" in name:
                parameter.add_(0.1)
    assert copy.refresh(version=0) is model
    assert not torch.allclose(_prompt_logprobs(model, prompts), _prompt_logprobs(policy, prompts), atol=1e-3)
    copy.refresh(version=1)  # a new version: merged again
    torch.testing.assert_close(_prompt_logprobs(model, prompts), _prompt_logprobs(policy, prompts), atol=1e-4, rtol=0)
    for name, parameter in policy.named_parameters():  # merged out of place: the policy's base is untouched
        if name in base:
            assert torch.equal(parameter, base[name]), name


def _sampled(model, tok, prompts, stops):
    """Three answers a prompt at temperature 0.8 with their log-probs, from the same seed whatever the model."""
    params = SamplingParams(num_generations=3, max_new_tokens=12, stop_ids=stops, temperature=0.8, with_logprobs=True)
    generator = torch.Generator().manual_seed(0)
    pad = tok.pad_token_id or 0
    return sample(model, prompts.input_ids, prompts.attention_mask, params, generator, pad_token_id=pad)


def test_a_float32_copy_samples_what_the_policy_samples_with_its_log_probs(lora_policy):
    policy, tok, prompts = lora_policy
    model = MergedCopy(policy, "float32").refresh(version=0)
    stops = stop_token_ids(policy, tok)
    ids, mask, _, logprobs = _sampled(policy, tok, prompts, stops)
    copy_ids, copy_mask, _, copy_logprobs = _sampled(model, tok, prompts, stops)
    assert torch.equal(copy_ids, ids) and torch.equal(copy_mask, mask)
    torch.testing.assert_close(copy_logprobs, logprobs, atol=1e-4, rtol=0)
    # the recorded log-probs are the trainer's scores of the tokens (the update's function) at the temperature
    sequence = torch.cat([prompts.input_ids.repeat_interleave(3, 0), ids], dim=1)
    attention = torch.cat([prompts.attention_mask.repeat_interleave(3, 0), mask], dim=1)
    with torch.no_grad():
        scored, _ = completion_logprobs(policy, sequence, attention, ids, 0.8, group_size=3)
    torch.testing.assert_close(logprobs, scored * mask, atol=1e-4, rtol=0)
    assert (logprobs[mask == 0] == 0).all() and (logprobs[mask == 1] < 0).all()


def test_a_bfloat16_copy_is_close_to_the_policy(lora_policy):
    policy, _, prompts = lora_policy
    model = MergedCopy(policy, "bfloat16").refresh(version=0)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in policy.parameters())  # the policy stays as it was
    gap = (_prompt_logprobs(model, prompts) - _prompt_logprobs(policy, prompts)).abs().max()
    assert 0 < gap < 0.1


def _causal(t: int, length: int) -> torch.Tensor:
    """[t, length]: a decode step's last t positions see the cache before them and each other causally."""
    keys = torch.arange(length)
    return keys <= keys[length - t :, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 3])  # one new position a row, or a speculative block of 3
def test_grouped_decode_attention_is_sdpa_with_grouped_query_heads(dtype, t):
    torch.manual_seed(0)
    query, key, value = (torch.randn(4, h, n, 16, dtype=dtype) for h, n in ((6, t), (2, 9), (2, 9)))
    module, tolerance = torch.nn.Module(), 1e-5 if dtype == torch.float32 else 2e-2
    padded = _causal(t, 9).expand(4, 1, t, 9).clone()
    padded[0, ..., :3] = False  # left padding of row 0
    for attention_mask, sdpa_mask in ((padded, padded), (None, _causal(t, 9))):  # None: causal, no padding
        expected = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=sdpa_mask,
                                                  scale=0.3, enable_gqa=True).transpose(1, 2)  # fmt: skip
        out, weights = grouped_decode_attention(module, query, key, value, attention_mask, scaling=0.3)
        assert out.shape == (4, t, 6, 16) and weights is None and out.dtype == dtype
        torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("t", [1, 3])
def test_grouped_decode_attention_on_a_shared_prompt_is_attention_on_each_rows_keys(dtype, masked, t):
    # 3 prompts of 5 positions (prompt 1 left-padded by 2), G = 4 rows each with 3 positions of their own (the last t
    # of them new): each prompt scored once for its group must give each row what SDPA gives on the row's prompt and
    # completion put together
    torch.manual_seed(0)
    query = torch.randn(12, 6, t, 16, dtype=dtype)
    key, value = (SharedPrefix(torch.randn(3, 2, 5, 16, dtype=dtype), torch.randn(12, 2, 3, 16, dtype=dtype))
                  for _ in range(2))  # fmt: skip
    mask = torch.ones(12, 1, t, 9, dtype=torch.bool)  # longer than the keys, as the rollout's mask is
    mask[..., :8] = _causal(t, 8)
    mask[4:8, ..., :2] = False
    expected = F.scaled_dot_product_attention(query.float(), key.materialize().float(), value.materialize().float(),
                                              attn_mask=mask[..., :8] if masked else _causal(t, 8), scale=0.3,
                                              enable_gqa=True).transpose(1, 2)  # fmt: skip
    out, _ = grouped_decode_attention(torch.nn.Module(), query, key, value, mask if masked else None, scaling=0.3)
    assert out.shape == (12, t, 6, 16) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)


def test_grouped_decode_attention_never_transposes_the_cache():
    # the keys as the rollout's cache hands them, the filled part of a longer buffer: [B, K, L, D] of [B, K, cap, D].
    # query @ key^T has a bfloat16 CPU matmul copy the keys transposed, [B*K, D, L], at every decode step (on
    # CPUs whose bfloat16 matmul wants contiguous operands: the test can catch the copy only there)
    query = torch.randn(8, 6, 1, 16, dtype=torch.bfloat16)
    key, value = (torch.randn(8, 2, 40, 16, dtype=torch.bfloat16)[:, :, :33] for _ in range(2))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiled:
        grouped_decode_attention(torch.nn.Module(), query, key, value, None, scaling=0.3)
    copied = [event.input_shapes[0] for event in profiled.events() if event.name in ("aten::clone", "aten::copy_")]
    assert [16, 16, 33] not in copied, copied


def test_the_training_rollout_samples_from_the_copy_and_the_update_corrects_it(make_module, make_datamodule):
    from tests.conftest import fit_one_grpo_step

    module = make_module(
        lora=LoraSettings(r=4, alpha=8, dropout=0.0), kl={"beta": 0.0},
        sampling={"num_generations": 4, "merged_copy": "float32", "importance_sampling_cap": 2.0},
    )  # fmt: skip
    trainer = fit_one_grpo_step(module, make_datamodule, batch_size=2)
    metrics = trainer.callback_metrics
    assert module.sampler.copy is not None and module.sampler.copy.version == 0  # sampled the first step's weights
    assert 0 <= metrics["train/engine_logprob_gap"] < 1e-4  # float32: the same distribution up to rounding
    assert not any(name.startswith("sampler") for name in module.state_dict())  # the copy is never saved


def _kind(model) -> str:
    """Which copy a model is: "prepacked" where its linear layers run packed, else its dtype."""
    if any(isinstance(m.__dict__.get("forward"), PackedLinear) for m in model.modules()):
        return "prepacked"
    return str(next(model.parameters()).dtype).removeprefix("torch.")


@pytest.mark.parametrize("prepack", [True, False])
@pytest.mark.parametrize("fast", ["float32", "bfloat16", "prepacked"])
def test_the_fastest_copy_is_the_choice_whose_median_draw_took_least(llama_policy, monkeypatch, fast, prepack):
    """Five timed draws a choice after a warm-up, their median; prepacked only where oneDNN has bf16; at most two
    copies alive at once."""
    policy, _, _ = llama_policy
    monkeypatch.setattr("interleave_model.generation.merged_copy.can_prepack", lambda device: prepack)
    # a pack that any CPU runs: the test is about the choice, not oneDNN
    monkeypatch.setattr("interleave_model.generation.merged_copy.prepack_linear_weight", lambda w, rows: w.clone())
    monkeypatch.setattr("interleave_model.generation.merged_copy.prepacked_linear", F.linear)
    now, drawn, alive = [0.0], [], weakref.WeakSet()
    monkeypatch.setattr("interleave_model.runtime.fastest.time.perf_counter", lambda: now[0])
    built = MergedCopy.__init__

    def init(self, *args, **kwargs):
        built(self, *args, **kwargs)
        alive.add(self)

    monkeypatch.setattr(MergedCopy, "__init__", init)
    base = {"float32": 3.0, "bfloat16": 2.0, "prepacked": 2.5} | {fast: 1.0}
    if fast == "prepacked" and not prepack:
        base["bfloat16"] = 1.0  # without prepacking the plain bfloat16 copy is the fastest left

    def draw(model):
        kind = _kind(model)
        drawn.append(kind)
        gc.collect()
        assert len(alive) <= 2
        now[0] += base[kind] * (1.0 + 0.1 * (drawn.count(kind) % 2))  # the draws of a choice spread 10%

    chosen, seconds, spread = fastest_copy(policy, draw, rows=6, repeats=AUTO_PROBE_DRAWS)
    choices = ["float32", "bfloat16", "prepacked"] if prepack else ["float32", "bfloat16"]
    expected = fast if fast in choices else "bfloat16"
    assert chosen.dtype == expected and _kind(chosen.model) == expected
    assert set(seconds) == set(choices) and sorted(drawn) == sorted(c for c in choices for _ in range(6))
    assert seconds[expected] == min(seconds.values()) and 0.09 < spread < 0.11


def test_the_prepacked_copy_samples_what_the_bfloat16_copy_samples_and_follows_updates(lora_policy):
    if not compat.can_prepack(torch.device("cpu")):  # read at run time: `--no-onednn-bf16` patches it
        pytest.skip("this CPU's oneDNN has no bf16 kernels")
    policy, tok, prompts = lora_policy
    plain, packed = MergedCopy(policy, "bfloat16", rows=6), MergedCopy(policy, "prepacked", rows=6)
    conv1d = "gpt2" in type(policy.get_base_model()).__name__.lower()  # GPT-2: Conv1D layers, nothing to pack
    assert packed.dtype == ("bfloat16" if conv1d else "prepacked")
    for version in (0, 1):
        drawn = [_sampled(copy.refresh(version), tok, prompts, stop_token_ids(policy, tok)) for copy in (plain, packed)]
        (ids, mask, _, logprobs), (packed_ids, packed_mask, _, packed_logprobs) = drawn
        assert torch.equal(packed_ids, ids) and torch.equal(packed_mask, mask)
        torch.testing.assert_close(packed_logprobs, logprobs, atol=0, rtol=0)
        assert packed.refresh_s > 0
        with torch.no_grad():  # an update moves the adapter: version 1 is merged and packed again
            for name, parameter in policy.named_parameters():
                if "lora_A" in name:
                    parameter.add_(0.1)
    if _kind(packed.model) == "prepacked":  # the packed layers' plain weights are freed
        head = packed.model.get_output_embeddings()
        linears = [m for m in packed.model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
        assert linears and all(m.weight.numel() == 0 for m in linears)


def test_where_onednn_has_no_bf16_the_prepacked_copy_is_the_bfloat16_one(lora_policy, monkeypatch):
    policy, _, prompts = lora_policy
    monkeypatch.setattr("interleave_model.generation.merged_copy.can_prepack", lambda device: False)
    copy = MergedCopy(policy, "prepacked", rows=6)
    model = copy.refresh(0)
    assert copy.dtype == "bfloat16" and _kind(model) == "bfloat16"
    expected = MergedCopy(policy, "bfloat16").refresh(0)
    torch.testing.assert_close(_prompt_logprobs(model, prompts), _prompt_logprobs(expected, prompts), atol=0, rtol=0)


def test_auto_picks_a_copy_once_on_the_first_training_rollout_and_says_so(make_module, make_datamodule, caplog):
    from tests.conftest import fit_one_grpo_step

    module = make_module(
        lora=LoraSettings(r=4, alpha=8, dropout=0.0), kl={"beta": 0.0},
        sampling={"num_generations": 2, "merged_copy": "auto", "importance_sampling_cap": 2.0},
    )  # fmt: skip
    with caplog.at_level("INFO"):
        fit_one_grpo_step(module, make_datamodule, batch_size=2)
    chosen = module.sampler.copy
    assert chosen is not None and chosen.dtype in ("float32", "bfloat16", "prepacked") and chosen.version == 0
    said = [r.getMessage() for r in caplog.records if "merged_copy: auto" in r.getMessage()]
    assert len(said) == 1 and f"from the {chosen.dtype} copy" in said[0] and "float32 " in said[0]


def test_merged_copy_settings_are_checked():
    assert Sampling(merged_copy="auto").merged_copy == "auto"
    assert Sampling(merged_copy="prepacked").merged_copy == "prepacked"
    with pytest.raises(SettingsError, match="model.sampling.merged_copy"):
        Sampling(merged_copy="float16")
    with pytest.raises(SettingsError, match="model.sampling.importance_sampling_cap"):
        Sampling(importance_sampling_cap=0.5)


def test_held_out_answers_come_from_a_copy_merged_in_the_policys_dtype(lora_policy, monkeypatch):
    """A LoRA policy's greedy held-out answers are the policy's own (real families' folders: byte-level BPE, several
    stop ids, no pad token), drawn from a float32 merged copy that follows the weights and is freed at the end."""
    from interleave_model.generation import sampler as sampler_py
    from interleave_model.generation.rollout import rollout
    from interleave_model.generation.sampler import Sampler

    policy, tok, prompts = lora_policy
    stops = stop_token_ids(policy, tok)
    sampler = Sampler(policy, tok, stops, sampling=Sampling())
    batch = {"prompt_ids": prompts.input_ids, "prompt_mask": prompts.attention_mask, "n_words": [3, 3],
             "target_ids": [[1, 2, 3], [1, 2, 3]]}  # fmt: skip
    built = []
    monkeypatch.setattr(sampler_py, "MergedCopy", lambda *a: built.append(a) or MergedCopy(*a))

    def own(model):  # the same call from a given model
        params = SamplingParams(num_generations=1, max_new_tokens=sampler.eval_budget(batch), stop_ids=stops,
                                temperature=0.0)  # fmt: skip
        return rollout(model, tok, prompts.input_ids, prompts.attention_mask, params)

    held_out = sampler.rollout(batch, 1, 0.0, version=0)
    assert [args[1] for args in built] == ["float32"] and sampler.held_out is not None
    assert held_out.texts == own(policy).texts and torch.equal(held_out.completion_ids, own(policy).completion_ids)
    with torch.no_grad():  # an update between two evaluations reaches the copy
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.05)
    assert sampler.rollout(batch, 1, 0.0, version=1).texts == own(policy).texts
    sampler.evaluation_ended()
    assert sampler.held_out is None and len(built) == 1
    plain = Sampler(policy.get_base_model(), tok, stops, sampling=Sampling())
    assert plain.rollout(batch, 1, 0.0, version=0).texts == own(policy.get_base_model()).texts
    assert plain.held_out is None and len(built) == 1  # no adapter: the model itself
