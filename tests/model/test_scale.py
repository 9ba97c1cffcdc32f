"""Scale: the Llama-3.2-3B architecture on the meta device (sizes, LoRA, where memory goes at group 16 x 500 words),
and the bf16-mixed and gradient-checkpointing switches on the tiny model, on a CPU. docs/SCALING.md quotes these."""

from __future__ import annotations

import math
from pathlib import Path
from unittest.mock import patch

import lightning as L
import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from interleave_model.algorithm import logprobs as logprobs_module
from interleave_model.algorithm.completions import completion_logprobs, fused_head
from interleave_model.algorithm.logprobs import (
    head_chunk_rows,
    head_token_logprobs,
    keeps_probs,
    token_entropy,
    token_logprobs,
)
from interleave_model.algorithm.rewards import RewardFunction
from interleave_model.generation.rollout import _draw, _uniform, sample, token_budget
from interleave_model.generation.sampling_params import SamplingParams
from interleave_model.model.policy import LoraSettings, TinyModelConfig, apply_lora
from tests.conftest import TINY_SHAPE

# meta-llama/Llama-3.2-3B(-Instruct) config.json, the fields that size the model
LLAMA_3_2_3B = {
    "vocab_size": 128256,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
}
CONFIG = yaml.safe_load((Path(__file__).parents[2] / "configs" / "llama-3.2-3b.yaml").read_text())
GROUP = CONFIG["model"]["sampling"]["num_generations"]  # 16
WORDS = 500  # the last curriculum stage
TOKENS_PER_WORD = 1.35  # Llama-3's tokenizer on English prose; interleaving keeps words whole, so about the same
TEMPLATE_TOKENS = 140  # the "two_processes" instruction plus the chat template around it
BF16 = 2
GIB = 2**30


def sequence_lengths() -> tuple[int, int]:
    """(prompt, completion budget) tokens of a 500-word stage, as the module sizes the budget."""
    prompt = math.ceil(2 * WORDS * TOKENS_PER_WORD) + TEMPLATE_TOKENS  # two 500-word fragments
    return prompt, token_budget([math.ceil(2 * WORDS * TOKENS_PER_WORD)])  # the answer interleaves both


@pytest.fixture(scope="module")
def llama_3b():
    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**LLAMA_3_2_3B)).to(torch.bfloat16)  # loaded with dtype: bfloat16


@pytest.fixture(scope="module")
def llama_3b_lora():
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_3_2_3B))
    # dropout 0, as configs/llama-3.2-3b.yaml sets: LoRA dropout keeps a dropped copy of every adapted input.
    # All in bf16 here, as the matmuls run under bf16-mixed (peft keeps the adapter weights themselves in fp32).
    return apply_lora(model, LoraSettings(r=16, alpha=32, dropout=0.0)).to(torch.bfloat16)


def test_llama_3b_has_3_21b_parameters(llama_3b):
    n = sum(p.numel() for p in llama_3b.parameters())  # the tied output layer counts once
    # embeddings 128256 * 3072 = 394.0M; per layer: q, o 3072^2, k, v 3072 * 1024, gate, up, down 3072 * 8192,
    # two norms 3072 -> 100.66M, * 28 = 2818.6M; final norm 3072: 3,212,749,824
    assert n == 3_212_749_824
    assert llama_3b.get_output_embeddings().weight is llama_3b.get_input_embeddings().weight


def test_lora_r16_on_all_projections_trains_24m(llama_3b_lora):
    trainable = sum(p.numel() for p in llama_3b_lora.parameters() if p.requires_grad)
    # r * (in + out) per projection: q, o 16 * 6144; k, v 16 * 4096; gate, up, down 16 * 11264
    # = 868,352 per layer, * 28 layers = 24,313,856 (0.76% of the model)
    per_layer = 16 * (2 * 6144 + 2 * 4096 + 3 * 11264)
    assert trainable == 28 * per_layer == 24_313_856
    adapted = {
        name.split(".lora_A")[0].split(".")[-1] for name, _ in llama_3b_lora.named_parameters() if "lora_A" in name
    }
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # all-linear


def _saved_bytes(fn, model: torch.nn.Module, length: int) -> int:
    """Bytes autograd keeps for the backward of `fn()` beyond `model`'s weights, each storage counted once.

    Works on meta tensors. There attention runs the math kernel, which keeps the [heads, L, L] probabilities; a GPU's
    flash or memory-efficient kernel keeps only a logsumexp, so those are left out.
    """
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage._cdata not in weights and tensor.shape[-2:] != (length, length):
            storages[storage._cdata] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(storages.values())


def memory_plan(model) -> dict[str, float]:
    """Where GPU memory goes in a GRPO step of Llama-3.2-3B + LoRA r=16 at 500 words, GiB, per group of 16 rows
    (in the rollout) and per micro-batch of 16 rows (in the update)."""
    config = model.config
    prompt, budget = sequence_lengths()
    length = prompt + budget
    layer = model.get_decoder().layers[0]
    hidden = torch.empty(1, length, config.hidden_size, device="meta", dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(length, device="meta")[None]
    rotary = model.get_decoder().rotary_emb(hidden, positions)
    per_row_layer = _saved_bytes(
        lambda: layer(hidden, position_embeddings=rotary, position_ids=positions), model, length
    )
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * BF16
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    chunk_rows = 2**26 // config.vocab_size  # logprobs.head_token_logprobs's default chunk on an accelerator
    return {
        "weights_bf16": sum(p.numel() for p in model.parameters() if not p.requires_grad) * BF16 / GIB,
        "lora_weights_grads_adam_fp32": trainable * (4 + 4 + 8) / GIB,
        # rollout: 16 rows of prompt + budget keys and values in every layer (the prompt is prefilled once, then
        # its cache is repeated across the group)
        "rollout_kv_cache": GROUP * length * kv_per_token / GIB,
        # update, gradient checkpointing: each layer keeps its input; backward recomputes one layer at a time
        "update_checkpoints": GROUP * length * config.hidden_size * BF16 * config.num_hidden_layers / GIB,
        "update_one_layer_recomputed": GROUP * per_row_layer / GIB,
        # update without checkpointing: every layer keeps all it saved
        "update_no_checkpointing": GROUP * per_row_layer * config.num_hidden_layers / GIB,
        # the completion logits, were they materialised: bf16 from the head, the fp32 copy, its gradient
        "logits_if_materialised": GROUP * budget * config.vocab_size * (BF16 + 4 + 4) / GIB,
        # the fused head instead: one fp32 [chunk, V] tile and its softmax at a time
        "fused_head_tiles": 2 * chunk_rows * config.vocab_size * 4 / GIB,
    }


def test_memory_plan_at_group_16_and_500_words_fits_one_80gb_gpu(llama_3b_lora):
    plan = memory_plan(llama_3b_lora)
    print({k: round(v, 2) for k, v in plan.items()})  # the table in docs/SCALING.md (pytest -s)
    prompt, budget = sequence_lengths()
    assert (prompt, budget) == (1490, 1693)
    assert 5.9 < plan["weights_bf16"] < 6.0  # 3.21B * 2 bytes
    assert plan["lora_weights_grads_adam_fp32"] < 0.4
    # 2 (k, v) * 28 layers * 8 heads * 128 * 2 bytes = 112 KiB per token, * 16 rows * 3183 tokens
    assert plan["rollout_kv_cache"] == pytest.approx(16 * 3183 * 114688 / GIB)
    assert plan["update_checkpoints"] == pytest.approx(16 * 3183 * 3072 * 2 * 28 / GIB)  # 8.2 GiB
    # without checkpointing the update alone would need well over a GPU; with it, one layer's worth at a time
    assert plan["update_no_checkpointing"] > 80 and plan["update_one_layer_recomputed"] < 10
    # the fused head is what makes the logits vanish: 23 GiB of them against half a GiB of tiles
    assert plan["logits_if_materialised"] > 20 and plan["fused_head_tiles"] <= 0.5
    # the shipped config: batch_size prompts of a group each in the rollout, micro_batch_size rows per update forward
    fixed = plan["weights_bf16"] + plan["lora_weights_grads_adam_fp32"]
    rollout = fixed + CONFIG["data"]["batch_size"] * plan["rollout_kv_cache"]  # 4 groups: 28 GiB
    per_row = (plan["update_checkpoints"] + plan["update_one_layer_recomputed"]) / GROUP
    update = fixed + CONFIG["model"]["optimization"]["micro_batch_size"] * per_row + plan["fused_head_tiles"]  # 22 GiB
    assert max(rollout, update) < 40  # the config's comments: a 40 GB A100 fits it, an 80 GB H100 has room


def test_fused_head_runs_at_llama_3b_shape_on_meta(llama_3b):
    # the 3B head (128256 x 3072) over 16 x 1693 completion tokens, in chunks: shapes only, no memory
    _, budget = sequence_lengths()
    hidden = torch.empty(GROUP * budget, 3072, device="meta", dtype=torch.bfloat16, requires_grad=True)
    weight = llama_3b.get_output_embeddings().weight
    tokens = torch.zeros(GROUP * budget, dtype=torch.long, device="meta")
    logprobs, entropy = head_token_logprobs(hidden, weight, tokens, with_entropy=True)
    assert logprobs.shape == entropy.shape == (GROUP * budget,) and logprobs.dtype == torch.float32


# ---- the bf16-mixed and gradient-checkpointing switches, on the tiny model on a CPU ----------------------------------


class CompletionLength(RewardFunction):
    """A reward that varies within a group from the first step (alignment is 0 everywhere for an untrained model)."""

    name = "length"

    def __call__(self, completions, targets, truncated):
        return [len(c) / 100 for c in completions]


@pytest.mark.parametrize(("precision", "checkpointing"), [("bf16-mixed", True), ("32-true", False)])
def test_a_training_step_runs_and_moves_weights(make_module, make_datamodule, precision, checkpointing):
    module = make_module(
        rewards=[CompletionLength()],
        base={"gradient_checkpointing": checkpointing},
        optimization={"learning_rate": 1e-2},
    )
    mlp = module.policy.get_decoder().layers[0].mlp  # inside the checkpointed forward, so its hook sees the recompute
    calls, dtypes = [], []
    # a pre-hook: the recompute stops as soon as it has rebuilt what backward needs, before any post-hook could fire
    mlp.register_forward_pre_hook(lambda mod, args: calls.append((torch.is_grad_enabled(), tuple(args[0].shape))))
    mlp.down_proj.register_forward_hook(lambda mod, args, out: dtypes.append(out.dtype))
    before = {k: v.detach().clone() for k, v in module.policy.named_parameters()}
    trainer = L.Trainer(
        accelerator="cpu", precision=precision, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=make_datamodule(module.tokenizer))
    moved = [k for k, v in module.policy.named_parameters() if not torch.equal(v, before[k])]
    assert moved and all(torch.isfinite(p).all() for p in module.policy.parameters())
    assert module.policy.get_decoder().layers[0].gradient_checkpointing == checkpointing
    # with checkpointing the backward runs the layer again on the same input, with grad, to rebuild what its forward
    # did not keep; without, a group's prompt and its completions are two forwards of their own shapes
    with_grad = [shape for grad, shape in calls if grad]
    assert len(with_grad) == 2 and (with_grad[0] == with_grad[1]) == checkpointing, with_grad
    if precision == "bf16-mixed":
        assert torch.bfloat16 in dtypes  # the projections ran under bf16 autocast
    assert all(p.dtype == torch.float32 for p in module.policy.parameters())  # mixed: fp32 master weights


# ---- what keeps a long step cheap: the fused LM head, the in-place KV cache, the one-uniform sampler -----------------


def test_fused_head_matches_the_logits_path_in_value_and_gradient():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 50, (37,))
    grad = torch.randn(37, dtype=torch.float64)
    # chunks of 5 rows: 8 chunks, the last one partial
    fused, entropy = head_token_logprobs(hidden, weight, tokens, 0.7, with_entropy=True, chunk_rows=5)
    logits = (hidden @ weight.T)[None]  # [1, 37, 50]
    plain = token_logprobs(logits, tokens[None], 0.7)[0]
    torch.testing.assert_close(fused, plain)
    torch.testing.assert_close(entropy, token_entropy(logits.detach(), 0.7)[0])
    grads = torch.autograd.grad((fused * grad).sum(), (hidden, weight))
    torch.testing.assert_close(grads, torch.autograd.grad((plain * grad).sum(), (hidden, weight)))


@pytest.mark.parametrize("with_entropy", [False, True])
def test_fused_head_keeping_its_softmax_gives_the_recomputed_gradient_bit_for_bit_with_one_matmul_less(
    monkeypatch, with_entropy
):
    torch.manual_seed(0)
    hidden = torch.randn(300, 64, requires_grad=True)  # float32, as a CPU update runs it
    weight = torch.randn(1000, 64, requires_grad=True)
    tokens = torch.randint(0, 1000, (300,))
    grad = torch.randn(300)
    calls = []
    head_logits = logprobs_module._head_logits
    monkeypatch.setattr(logprobs_module, "_head_logits", lambda *a: calls.append(1) or head_logits(*a))
    results = {}
    for keep in (False, True, None):  # None: the default, which keeps a [300, 1000] softmax
        calls.clear()
        fused, entropy = head_token_logprobs(
            hidden, weight, tokens, 0.7, with_entropy=with_entropy, chunk_rows=128, keep_probs=keep
        )
        forward_calls = len(calls)
        grads = torch.autograd.grad((fused * grad).sum(), (hidden, weight))
        results[keep] = (fused, entropy, grads, forward_calls, len(calls) - forward_calls)
    recomputed, kept, default = results[False], results[True], results[None]
    assert torch.equal(recomputed[0], kept[0])  # log-probs
    assert (recomputed[1] is kept[1] is None) or torch.equal(recomputed[1], kept[1])  # entropies
    assert all(torch.equal(a, b) for a, b in zip(recomputed[2], kept[2], strict=True))  # both gradients
    assert recomputed[3:] == (3, 3) and kept[3:] == (3, 0) and default[3:] == (3, 0)  # 3 chunks of <= 128 rows
    with torch.no_grad():  # nothing to differentiate: nothing kept
        calls.clear()
        head_token_logprobs(hidden, weight, tokens, chunk_rows=128)
    assert len(calls) == 3


def test_the_fused_head_keeps_a_softmax_of_at_most_256_mib():
    assert keeps_probs(8 * 96, 49152)  # a micro-batch of 8 SmolLM2 completions at a 10-word budget: 144 MiB
    assert not keeps_probs(32 * 96, 49152)  # the same 32 rows in one batch: 576 MiB, recomputed
    assert not keeps_probs(16 * 1693, 128256)  # Llama-3 at 500 words: recomputed in chunks, as the memory plan says


def test_the_fused_heads_cpu_chunks_hold_at_least_128_rows_and_4_mib_on_a_small_vocabulary():
    assert head_chunk_rows(49152, "cpu") == 128  # SmolLM2's head: 4 MiB would be 21 rows, each reading the weight
    assert head_chunk_rows(128256, "cpu") == 128
    assert head_chunk_rows(1000, "cpu") == 2**20 // 1000  # a small vocabulary's 4 MiB chunk is already larger
    assert head_chunk_rows(128256, "cuda") == 2**26 // 128256


def test_module_scores_the_same_through_the_fused_head_and_the_logits(make_module):
    module = make_module(tiny=TinyModelConfig(**TINY_SHAPE, freeze_embeddings=False), sampling={"temperature": 0.9})
    ids = torch.randint(5, len(module.tokenizer), (4, 12))
    attention = torch.ones_like(ids)
    attention[0, :3] = 0  # left padding
    attention[1, -2:] = 0  # a completion that ended early: the last 2 positions are past its EOS
    completion = ids[:, -5:]

    def score(fused: bool):
        module.policy.zero_grad()
        head = fused_head(module.policy) if fused else None
        with patch("interleave_model.algorithm.completions.fused_head", lambda model: head):
            logprobs, entropy = completion_logprobs(
                module.policy, ids, attention, completion, module.temperature, with_entropy=True
            )
        keep = attention[:, -5:].bool()
        (logprobs * keep).sum().backward()
        grads = {k: p.grad.clone() for k, p in module.policy.named_parameters() if p.grad is not None}
        return logprobs[keep], entropy[keep], grads

    fused, plain = score(True), score(False)
    torch.testing.assert_close(fused[0], plain[0])
    torch.testing.assert_close(fused[1], plain[1], atol=1e-4, rtol=1e-4)
    assert fused[2].keys() == plain[2].keys() and fused[2]
    for name in plain[2]:
        torch.testing.assert_close(fused[2][name], plain[2][name], atol=1e-5, rtol=1e-4)


def test_sampler_draws_in_proportion_and_never_a_zero_weight_token():
    vocab = 2 * 256 + 37  # two full blocks and a partial one
    weights = torch.zeros(vocab)
    weights[[0, 255, 256, 300, vocab - 1]] = torch.tensor([3.0, 1.0, 2.0, 0.5, 3.5])  # total 10
    uniform = _uniform(100_000, torch.Generator().manual_seed(0), weights.device)  # [100k, 1]
    draws, totals = _draw(weights.expand(100_000, vocab).contiguous(), uniform)
    assert totals.dtype == torch.float64 and torch.equal(totals, torch.full((100_000,), 10.0, dtype=torch.float64))
    counts = torch.bincount(draws, minlength=vocab).double() / draws.numel()
    assert counts[weights == 0].sum() == 0
    # binomial standard error at 100k draws is at most 0.0016
    torch.testing.assert_close(counts[weights > 0], weights[weights > 0].double() / 10, atol=0.006, rtol=0)


def test_long_grouped_rollout_with_the_in_place_cache_is_greedy_exact(make_module):
    module = make_module(tiny=TinyModelConfig(**TINY_SHAPE, embedding_std=0.5))
    tok = module.tokenizer
    enc = tok(["A: the first B: a second Interleave:", "A: x B: y z Interleave:"], return_tensors="pt", padding=True)
    ids, mask = enc.input_ids, enc.attention_mask
    params = SamplingParams(num_generations=3, max_new_tokens=80, stop_ids=[tok.eos_token_id], temperature=0.0)
    grouped, *_ = sample(module.policy, ids, mask, params, pad_token_id=tok.pad_token_id)
    reference = module.policy.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=80, do_sample=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    reference = reference[:, ids.shape[1] :][:, : grouped.shape[1]]
    assert grouped.shape[1] > 40  # long enough to cross many cache writes
    for g in range(3):
        assert torch.equal(grouped[g::3], reference)
