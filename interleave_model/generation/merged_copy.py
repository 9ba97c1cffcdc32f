"""A copy of the policy to sample the training rollout from: the adapter merged into the weights, in a chosen dtype.

Under LoRA every adapted linear layer runs three matmuls and a handful of element-wise ops per decode step; merged,
one. In bfloat16 a CPU with bf16 instructions (AVX512-BF16, AMX) reads half the bytes per step. The copy is a plain
model of the base's architecture (no peft), outside the LightningModule (never saved, never synchronised by DDP),
refreshed from the policy whenever its weights changed: each adapted layer's weight becomes `base + delta`, and
every other trainable parameter is copied, computed out of place, so the policy's own weights are never touched.

Decoding in bfloat16 with torch's scaled-dot-product attention is slow on a CPU (its bf16 kernel takes ~10x the
float32 one for one query against a GQA cache), so the copy's decode steps attend by `grouped_decode_attention`:
two matmuls with each KV head's query heads side by side, no repeated KV, for one new position a row or a short block
of them (speculative sampling's last token and drafts). The prefill and any attention with options it does not
implement (soft-capping, sinks) go to transformers' SDPA as before.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from interleave_model.generation.rollout_cache import SharedPrefix
from interleave_model.model.policy import is_peft
from interleave_model.runtime.compat import can_prepack, prepack_linear_weight, prepacked_linear
from interleave_model.runtime.fastest import agreed, timed

GROUPED_DECODE = "grouped_decode"  # the attention implementation the copy runs under (masks built as for SDPA)
DECODE_BLOCK = 16  # the most new positions a row that a step attends by `grouped_decode_attention` (more: SDPA)
PREPACKED = "prepacked"  # bfloat16, each decoder linear layer's weight in oneDNN's blocked layout (CPU)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, PREPACKED: torch.bfloat16}


def grouped_decode_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """Attention of a decode step's T new positions per row (1, or a speculative block of up to `DECODE_BLOCK`)
    against the cache, as transformers' attention functions are called.

    query [B, H, T, D], key / value [B, K, L, D] with H a multiple of K and T < L (the new positions are the last T);
    `attention_mask` SDPA's [B, 1, T, L] (boolean, True: attend; or additive) or None (causal). Returns
    ([B, T, H, D], None). Scores and softmax are float32 whatever the dtype. Keys and values may come as
    `SharedPrefix` (the rollout cache's prompts kept once per group): each prompt is then scored once for its whole
    group.
    """
    unsupported = {name for name in ("softcap", "s_aux", "sinks") if kwargs.get(name) is not None}
    b, h, t, d = query.shape
    length = key.prompt.shape[-2] + key.rows.shape[-2] if isinstance(key, SharedPrefix) else key.shape[-2]
    if t > DECODE_BLOCK or t >= length or dropout or unsupported:  # the prefill, or what it does not implement
        if isinstance(key, SharedPrefix):
            key, value = key.materialize(), value.materialize()
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)  # fmt: skip
    k = key.prompt.shape[1] if isinstance(key, SharedPrefix) else key.shape[1]
    scale = d**-0.5 if scaling is None else scaling
    grouped = query.reshape(b, k, h // k * t, d)  # KV head k's query heads side by side, T positions each
    if isinstance(key, SharedPrefix):
        out = _shared_prefix_attention(grouped, key, value, attention_mask, scale, t)
    else:
        weights = _masked_softmax(_scores(key, grouped, scale), attention_mask, t).to(value.dtype)
        out = torch.matmul(weights, value)  # [B, K, H/K*T, D]
    return out.reshape(b, h, t, d).transpose(1, 2), None


def _scores(key: Tensor, grouped: Tensor, scale: float) -> Tensor:
    """key [B, K, L, D] against grouped queries [B, K, Q, D]: [B, K, Q, L] float32, scaled. key @ query^T, then the
    small result transposed: query @ key^T would copy the transposed cache at every step."""
    return torch.matmul(key, grouped.transpose(-1, -2)).transpose(-1, -2).float() * scale


def _masked_softmax(scores: Tensor, attention_mask: Tensor | None, t: int) -> Tensor:
    """Softmax of `scores` [B, K, Q*T, L] (T positions innermost) over L, under SDPA's mask [B, 1, >= T, >= L]
    (boolean: True attends, or additive; its last T rows) or, when None, causally: position i of T sees the
    first L - T + i + 1 keys."""
    if attention_mask is None and t == 1:
        return scores.softmax(-1)
    b, k, rows, length = scores.shape
    scores = scores.reshape(b, k, rows // t, t, length)
    if attention_mask is None:
        keys = torch.arange(length, device=scores.device)
        mask = keys <= keys[length - t :, None]  # [T, L]
    else:
        mask = attention_mask[..., -t:, :length][:, :, None]  # [B, 1, 1, T, L]
    scores = scores.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else scores + mask
    return scores.softmax(-1).reshape(b, k, rows, length)


def _shared_prefix_attention(
    grouped: Tensor, key: SharedPrefix, value: SharedPrefix, attention_mask: Tensor | None, scale: float, t: int
) -> Tensor:
    """A decode step's queries against a prompt shared by each group of G rows and the row's own completion.

    grouped [B, K, Q, D] (B = P*G rows, group-major; Q: the query heads per KV head times the T positions, positions
    innermost); key / value prompt [P, K, Lp, D],
    rows [B, K, n, D]. The prompt part runs once per group with its G rows' queries side by side ([P, K, G*Q, D]),
    so its keys and values are read once, not G times; one softmax covers both parts. Returns [B, K, Q, D].
    """
    b, k, q, d = grouped.shape
    p, _, length, _ = key.prompt.shape
    g = b // p

    def by_group(x: Tensor) -> Tensor:  # [B, K, Q, X] -> [P, K, G*Q, X]
        return x.reshape(p, g, k, q, -1).transpose(1, 2).reshape(p, k, g * q, -1)

    def by_row(x: Tensor) -> Tensor:  # [P, K, G*Q, X] -> [B, K, Q, X]
        return x.reshape(p, k, g, q, -1).transpose(1, 2).reshape(b, k, q, -1)

    scores = torch.cat([by_row(_scores(key.prompt, by_group(grouped), scale)), _scores(key.rows, grouped, scale)],
                       dim=-1)  # fmt: skip  # [B, K, Q, Lp + n]
    weights = _masked_softmax(scores, attention_mask, t).to(value.rows.dtype)
    prompt_weights, row_weights = weights.split([length, weights.shape[-1] - length], dim=-1)
    out = by_row(torch.matmul(by_group(prompt_weights), value.prompt))  # [B, K, Q, D]
    return out + torch.matmul(row_weights, value.rows)


AttentionInterface.register(GROUPED_DECODE, grouped_decode_attention)
AttentionMaskInterface.register(GROUPED_DECODE, sdpa_mask)


class MergedCopy:
    """The policy's weights, merged and cast to `dtype`, in a model that only samples.

    Args:
        policy: The policy, LoRA-wrapped (peft) or not.
        dtype: "float32", "bfloat16", or "prepacked": bfloat16 with every decoder linear layer's weight reordered into
            oneDNN's blocked layout for `rows` rows a call (what inductor's CPU weight prepacking emits), so that no
            decode step reorders it again. The pack is redone at each refresh, since the weights change every step
            (`refresh_s` counts it); the plain bfloat16 weights of those layers are freed. Where oneDNN has no bf16
            (`compat.can_prepack`), or where the model has no linear layer to pack, "prepacked" is the plain
            "bfloat16" copy, and says so in `dtype`.
        rows: Rows a decode step runs (the rollout's prompts x G), the packed layout's size hint.

    Attributes:
        refresh_s: Seconds of the last refresh that changed the weights (merge, cast and any pack).
    """

    def __init__(self, policy: torch.nn.Module, dtype: str, rows: int = 1) -> None:
        with torch.no_grad():
            model = copy.deepcopy(policy)
            model = model.merge_and_unload() if is_peft(model) else model
        self.model = model.to(DTYPES[dtype]).eval().requires_grad_(False)
        device = next(self.model.parameters()).device
        self.dtype = dtype if dtype != PREPACKED or can_prepack(device) else "bfloat16"
        try:
            self.model.set_attn_implementation(GROUPED_DECODE)
        except ValueError:  # an architecture transformers does not run with custom attention keeps its own
            pass
        self.version: object = None  # the policy's weights the copy holds (the module's global step)
        self.refresh_s = 0.0
        self._sources = _sources(policy, self.model)
        self._packed = _prepack(self.model, rows) if self.dtype == PREPACKED else {}
        if self.dtype == PREPACKED and not self._packed:  # no linear layer to pack (GPT-2's are Conv1D)
            self.dtype = "bfloat16"

    @torch.no_grad()
    def refresh(self, version: object) -> torch.nn.Module:
        """The copy, holding the policy's weights of `version` (merged, cast and packed again only when it changed)."""
        if version != self.version or version is None:
            began = time.perf_counter()
            for target, weight in self._sources:
                packed = self._packed.get(target)
                if packed is None:
                    target.copy_(weight())
                else:
                    packed.pack(weight().to(torch.bfloat16))
            self.version, self.refresh_s = version, time.perf_counter() - began
        return self.model


class PackedLinear:
    """A linear layer's call on its weight in oneDNN's blocked layout (`compat.prepacked_linear`); it stands in for
    the layer's `forward`, so the layer keeps its place, its hooks and its bias."""

    def __init__(self, layer: torch.nn.Linear, rows: int) -> None:
        self.layer, self.rows = layer, rows
        self.pack(layer.weight)
        layer.weight.data = torch.empty(0, dtype=layer.weight.dtype, device=layer.weight.device)  # freed

    def pack(self, weight: Tensor) -> None:
        self.weight = prepack_linear_weight(weight, self.rows)

    def __call__(self, x: Tensor) -> Tensor:
        return prepacked_linear(x, self.weight, self.layer.bias)


def _prepack(model: torch.nn.Module, rows: int) -> dict[Tensor, PackedLinear]:
    """Every linear layer of `model` but the output head (which may share the embeddings' weight) run from a packed
    weight, in place; each by its weight parameter, which refreshes pack instead of copying into."""
    head = model.get_output_embeddings()
    packed = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            module.forward = packed[module.weight] = PackedLinear(module, rows)
    return packed


def _sources(policy: torch.nn.Module, merged: torch.nn.Module) -> list[tuple[Tensor, Callable[[], Tensor]]]:
    """(a parameter of the copy, a function giving its value from the policy) for every weight training can change:
    each adapted layer's `base + delta`, and every other parameter that requires a gradient."""
    from peft.tuners.lora import LoraLayer

    source = policy.get_base_model() if is_peft(policy) else policy
    params = dict(merged.named_parameters(remove_duplicate=False))
    pairs = []
    for name, module in source.named_modules():
        if isinstance(module, LoraLayer):
            pairs.append((params[f"{name}.weight"], lambda m=module: _merged_weight(m)))
    for name, parameter in source.named_parameters():
        if parameter.requires_grad and "lora_" not in name:
            pairs.append((params[name.replace(".base_layer.", ".")], lambda p=parameter: p))
    return pairs


def _merged_weight(layer) -> Tensor:
    """An adapted linear layer's weight with its active adapters' deltas added (out of place)."""
    weight = layer.get_base_layer().weight
    if layer.merged:  # someone merged the adapter into the base already
        return weight
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:
            weight = weight + layer.get_delta_weight(adapter)
    return weight


def fastest_copy(
    policy: torch.nn.Module, draw: Callable[[torch.nn.Module], object], rows: int, repeats: int
) -> tuple[MergedCopy, dict[str, float], float]:
    """The merged copy, float32, bfloat16 or (where oneDNN has bf16) prepacked, whose `draw` (a short rollout) takes
    the least wall time here; each choice's seconds, the median of `repeats` draws after a warm-up, the same on every
    rank (`fastest.agreed`); and the host's spread, the largest (slowest - fastest) / median of one choice's draws.
    Two choices closer than the spread are a tie by measurement, whichever is kept. The copies are built one at a
    time and only the fastest so far is kept, so at most two are held at once."""
    device = next(policy.parameters()).device
    choices = [dtype for dtype in DTYPES if dtype != PREPACKED or can_prepack(device)]
    best, seconds, spread = None, {}, 0.0
    for dtype in choices:
        merged = MergedCopy(policy, dtype, rows)
        if merged.dtype in seconds:  # "prepacked" with nothing to pack: the bfloat16 copy again
            continue
        times = timed(partial(draw, merged.refresh(None)), repeats + 1)
        seconds[merged.dtype] = statistics.median(times)
        spread = max(spread, (max(times) - min(times)) / seconds[merged.dtype])
        if best is None or seconds[merged.dtype] < seconds[best.dtype]:
            best = merged
        del merged
    seconds = agreed(seconds, device)
    chosen = min(seconds, key=seconds.get)
    return (best if best.dtype == chosen else MergedCopy(policy, chosen, rows)), seconds, spread
