"""The sampler's KV cache: one buffer per layer sized for the whole rollout, the group's prefill written into it."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class GroupLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values live in one [B*G, H, capacity, D] buffer for the whole rollout.

    `DynamicLayer.update` concatenates, so every decode step copies the whole cache and a rollout's copying grows with
    the square of its length; here a step writes one position. The prefill of B prompts is written straight into the
    buffer's B*G rows (each prompt's keys once per group member), so no G-fold copy of the prefill is ever made beside
    the buffer (`batch_repeat_interleave` would make one, and the buffer a second). `keys` / `values` are views of
    the buffer's filled part.
    """

    def __init__(self, capacity: int, group: int) -> None:
        super().__init__()
        self.capacity, self.group = capacity, group
        self._buffers: tuple[Tensor, Tensor] | None = None

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
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
        selected = []
        for buffer in self._buffers:
            smaller = buffer.new_empty(indices.shape[0], *buffer.shape[1:])
            smaller[:, :, :end] = buffer[indices, :, :end]
            selected.append(smaller)
        self._buffers = tuple(selected)
        self.keys, self.values = (buffer[:, :, :end] for buffer in self._buffers)

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


def rollout_cache(model: torch.nn.Module, capacity: int, group: int) -> tuple[DynamicCache, bool]:
    """A KV cache for one rollout of `group` completions per prompt, and whether its prefill fills the whole group.

    In-place `GroupLayer`s of `capacity` positions when every layer is a plain full-attention one; sliding-window
    and other special layers keep their own class, and the caller repeats their prefill (`batch_repeat_interleave`).
    """
    config = getattr(model, "config", None)
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    grouped = plain_layers(cache)
    if grouped:
        cache.layers = [GroupLayer(capacity, group) for _ in cache.layers]
    return cache, grouped
