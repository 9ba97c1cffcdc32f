"""The sampler's KV cache: one buffer per layer sized for the whole rollout, the group's prefill written into it (or
kept once per group, `SharedPrefix`)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class SharedPrefix(NamedTuple):
    """The keys (or values) a decode step attends to when a group's rows share their prompt: the prompt once per
    group and each row's own completion. Rows are group-major: row r answers prompt r // G, G = rows / prompts."""

    prompt: Tensor  # [P, K, Lp, D]
    rows: Tensor  # [P*G, K, n, D]

    def materialize(self) -> Tensor:
        """The per-row keys [P*G, K, Lp + n, D] an attention without prefix sharing takes (one copy)."""
        group = self.rows.shape[0] // self.prompt.shape[0]
        return torch.cat([self.prompt.repeat_interleave(group, dim=0), self.rows], dim=-2)


class GroupLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values live in one [B*G, H, capacity, D] buffer for the whole rollout.

    `DynamicLayer.update` concatenates, so every decode step copies the whole cache and a rollout's copying grows with
    the square of its length; here a step writes one position. The prefill of B prompts is written straight into the
    buffer's B*G rows (each prompt's keys once per group member), so no G-fold copy of the prefill is ever made beside
    the buffer (`batch_repeat_interleave` would make one, and the buffer a second). `keys` / `values` are views of
    the buffer's filled part.

    With `shared`, the prefill is kept once per prompt and the buffer holds the completions only; a decode step gets
    `SharedPrefix` keys and values, which an attention that reads them (`merged_copy.grouped_decode_attention`)
    scores with the G rows' queries side by side, so a step reads each prompt's keys once instead of G times. The
    first retirement of rows writes the per-row layout (one copy) and the layer goes on as an unshared one.
    """

    def __init__(self, capacity: int, group: int, shared: bool = False) -> None:
        super().__init__()
        self.capacity, self.group, self.shared = capacity, group, shared
        self._buffers: tuple[Tensor, Tensor] | None = None
        self._prompt: tuple[Tensor, Tensor] | None = None  # the shared prefill [B, H, Lp, D], keys and values
        self._end = 0  # positions filled, prompt included

    def get_seq_length(self) -> int:
        return self._end

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self._end
        end = self._end = start + key_states.shape[-2]
        if start == 0 and self.shared:  # the prefill, kept as it is; the buffer gets the B*G rows' completions
            self._prompt = (key_states, value_states)
            b, h, length, d = key_states.shape
            width = max(self.capacity, end) - length
            self._buffers = tuple(x.new_empty(b * self.group, h, width, d) for x in (key_states, value_states))
            return key_states, value_states
        if self._prompt is not None:  # a shared decode step: write the rows' part, hand over both parts
            length = self._prompt[0].shape[-2]
            if end - length > self._buffers[0].shape[-2]:
                self._buffers = tuple(self._resized(buffer, start - length, end - length) for buffer in self._buffers)
            self._buffers[0][:, :, start - length : end - length] = key_states
            self._buffers[1][:, :, start - length : end - length] = value_states
            keys, values = (SharedPrefix(prompt, buffer[:, :, : end - length])
                            for prompt, buffer in zip(self._prompt, self._buffers, strict=True))  # fmt: skip
            return keys, values
        if start == 0:  # the prefill: its own attention needs only its B rows, the buffer gets B*G
            self._buffers = tuple(self._group_buffer(x, max(self.capacity, end)) for x in (key_states, value_states))
            self.keys, self.values = (buffer[:, :, :end] for buffer in self._buffers)
            return key_states, value_states
        if end > self._buffers[0].shape[-2]:  # past the capacity (a caller's longer run): grow once, by copying
            self._buffers = tuple(self._resized(buffer, start, end) for buffer in self._buffers)
        self._buffers[0][:, :, start:end] = key_states
        self._buffers[1][:, :, start:end] = value_states
        self.keys, self.values = (buffer[:, :, :end] for buffer in self._buffers)  # [B*G, H, end, D] each
        return self.keys, self.values

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keep only the rows `indices` [R]: a smaller buffer holding their filled part (the old one is freed)."""
        end = self.get_seq_length()
        if self._prompt is not None:  # shared: the kept rows' prompts and completions in a per-row buffer
            length = self._prompt[0].shape[-2]
            buffers = []
            for prompt, buffer in zip(self._prompt, self._buffers, strict=True):
                rows = buffer.new_empty(indices.shape[0], buffer.shape[1], length + buffer.shape[2], buffer.shape[3])
                rows[:, :, :length] = prompt[indices // self.group]
                rows[:, :, length:end] = buffer[indices, :, : end - length]
                buffers.append(rows)
            self._buffers, self._prompt = tuple(buffers), None
            self.keys, self.values = (buffer[:, :, :end] for buffer in self._buffers)
            return
        selected = []
        for buffer in self._buffers:
            smaller = buffer.new_empty(indices.shape[0], *buffer.shape[1:])
            smaller[:, :, :end] = buffer[indices, :, :end]
            selected.append(smaller)
        self._buffers = tuple(selected)
        self.keys, self.values = (buffer[:, :, :end] for buffer in self._buffers)

    def compact(self, keep: Tensor, width: int) -> None:
        """Squeeze out the entries a speculative rollout rejected: each row's entries that `keep` [R, L] marks, in
        their order, move to its first positions; the cache is `width` long after (the longest row's kept count),
        and the rest of a shorter row's first `width` positions hold dropped entries, which its mask hides."""
        if self._prompt is not None:
            raise ValueError("a cache of shared prompts cannot be compacted")
        order = torch.sort((~keep).long(), dim=-1, stable=True).indices[:, :width]  # [R, width] kept ones first
        for buffer in self._buffers:
            index = order[:, None, :, None].expand(-1, buffer.shape[1], -1, buffer.shape[-1])
            buffer[:, :, :width] = buffer[:, :, : self._end].gather(2, index)
        self._end = width
        self.keys, self.values = (buffer[:, :, :width] for buffer in self._buffers)

    def _group_buffer(self, prefill: Tensor, capacity: int) -> Tensor:
        """A [B*G, H, capacity, D] buffer whose rows b*G .. b*G+G-1 start with `prefill` [B, H, L, D]'s row b."""
        b, h, length, d = prefill.shape
        buffer = prefill.new_empty(b * self.group, h, capacity, d)
        buffer.view(b, self.group, h, capacity, d)[:, :, :, :length] = prefill[:, None]
        return buffer

    @staticmethod
    def _resized(buffer: Tensor, filled: int, capacity: int) -> Tensor:
        grown = buffer.new_empty(*buffer.shape[:2], capacity, buffer.shape[-1])
        grown[:, :, :filled] = buffer[:, :, :filled]
        return grown


def plain_layers(cache: DynamicCache) -> bool:
    """True when the cache has layers and every one is a plain full-attention `DynamicLayer` (no sliding window)."""
    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


def rollout_cache(model: torch.nn.Module, capacity: int, group: int, shared: bool = False) -> tuple[DynamicCache, bool]:
    """A KV cache for one rollout of `group` completions per prompt, and whether its prefill fills the whole group.

    In-place `GroupLayer`s of `capacity` positions when every layer is a plain full-attention one (keeping each
    prompt once per group with `shared`, for a model whose attention reads `SharedPrefix`); sliding-window and other
    special layers keep their own class, and the caller repeats their prefill (`batch_repeat_interleave`).
    """
    config = getattr(model, "config", None)
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    grouped = plain_layers(cache)
    if grouped:
        cache.layers = [GroupLayer(capacity, group, shared=shared and group > 1) for _ in cache.layers]
    return cache, grouped
