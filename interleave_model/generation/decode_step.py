"""One decode step of the own sampler: a plain Llama's run op for op as transformers runs it, without its module stack.

transformers' Llama forward takes every decode step through decorators, keyword plumbing, mask creation and a module
call per norm, projection and layer; on the embedded tiny model (4 layers, width 128, 16 rows) that wrapping is about a
sixth of a decode step. `llama_step` makes the same tensor calls in the same order on the same weights and the same
cache, so its logits are bitwise those of `model(...)` (tests/model/generation/test_decode_step.py holds it to that,
greedy and sampled, padded or not). Any other model (another class, a peft wrapper, the merged copy's attention, hooks,
training mode) steps through `model(...)`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import LlamaForCausalLM

# (input_ids [R, 1], attention_mask sliced to the step or None, position_ids [R, 1], cache) -> logits [R, V]
Step = Callable[[Tensor, Tensor | None, Tensor, object], Tensor]


def decode_step(model: torch.nn.Module) -> Step:
    """The function that runs one decode step of `model` (`Step`): `llama_step` for a plain Llama, else its forward."""
    return partial(llama_step, model) if plain_llama(model) else partial(model_step, model)


def model_step(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor,
               cache) -> Tensor:  # fmt: skip
    """One decode step through the model's own forward: the next-token logits [R, V]."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=cache, use_cache=True)  # fmt: skip
    return out.logits[:, -1]


def plain_llama(model: torch.nn.Module) -> bool:
    """Whether `llama_step` runs `model` as its forward would: a `LlamaForCausalLM` itself (no wrapper, no subclass)
    in eval mode under SDPA, with SiLU, no biases, as many key/value heads as query heads, default rotary positions,
    no hub kernels, and no module with hooks or a forward of its own (the merged copy's packed linear layers)."""
    config = getattr(model, "config", None)
    if type(model) is not LlamaForCausalLM or model.training or config is None:
        return False
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    rewired = any(m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m) for m in model.modules())
    return (config._attn_implementation == "sdpa" and config.hidden_act == "silu" and rope == "default"
            and not config.attention_bias and not config.mlp_bias and not getattr(model, "_use_kernels", False)
            and config.num_key_value_heads == config.num_attention_heads and not rewired)  # fmt: skip


@torch.no_grad()
def llama_step(model: LlamaForCausalLM, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor,
               cache) -> Tensor:  # fmt: skip
    """`model(...)`'s decode step, op for op (transformers 5's `LlamaForCausalLM.forward` with one new token a row):
    the next-token logits [R, V]. `attention_mask` is what the sampler passes for the step: None or a 4-D mask, which
    transformers hands SDPA as it is."""
    decoder = model.model
    hidden = decoder.embed_tokens(input_ids)  # [R, 1, H]
    cos, sin = decoder.rotary_emb(hidden, position_ids)  # [R, 1, D] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [R, 1, 1, D]: over the heads
    for layer in decoder.layers[: model.config.num_hidden_layers]:
        attention, mlp = layer.self_attn, layer.mlp
        normed = _rms_norm(layer.input_layernorm, hidden)
        shape = (*normed.shape[:-1], -1, attention.head_dim)  # [R, 1, heads, D]
        query, key, value = (F.linear(normed, proj.weight).view(shape).transpose(1, 2)
                             for proj in (attention.q_proj, attention.k_proj, attention.v_proj))  # fmt: skip
        query, key = query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin
        key, value = cache.update(key, value, attention.layer_idx)  # [R, heads, L, D] each
        mixed = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                               scale=attention.scaling, is_causal=False)  # fmt: skip
        mixed = mixed.transpose(1, 2).contiguous().reshape(*normed.shape[:-1], -1).contiguous()  # [R, 1, H]
        hidden = hidden + F.linear(mixed, attention.o_proj.weight)
        normed = _rms_norm(layer.post_attention_layernorm, hidden)
        gated = mlp.act_fn(F.linear(normed, mlp.gate_proj.weight)) * F.linear(normed, mlp.up_proj.weight)
        hidden = hidden + F.linear(gated, mlp.down_proj.weight)
    return F.linear(_rms_norm(decoder.norm, hidden), model.lm_head.weight)[:, -1]  # [R, V]


def _rms_norm(norm: torch.nn.Module, hidden: Tensor) -> Tensor:
    """`LlamaRMSNorm.forward`: computed in float32, scaled by the norm's weight in the input's dtype."""
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return norm.weight * (hidden * torch.rsqrt(variance + norm.variance_epsilon)).to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    """transformers' `rotate_half`: the last dimension's halves swapped, the second negated."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
