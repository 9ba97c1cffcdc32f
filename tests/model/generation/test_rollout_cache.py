"""The sampler's KV cache: the group's prefill written once into its buffer, decode steps in place, rows retired."""

from __future__ import annotations

import torch

from interleave_model.generation.rollout_cache import GroupLayer, SharedPrefix


def test_prefill_fills_every_group_row_and_decode_writes_in_place():
    layer = GroupLayer(capacity=6, group=3)
    prefill = torch.randn(2, 1, 4, 8)  # [B, H, L, D]
    keys, _ = layer.update(prefill, -prefill)
    assert keys is prefill  # the prefill attends with its own B rows
    assert layer.keys.shape == (6, 1, 4, 8)
    assert torch.equal(layer.keys, prefill.repeat_interleave(3, dim=0))  # rows b*G .. b*G+G-1 hold prompt b
    assert torch.equal(layer.values, -prefill.repeat_interleave(3, dim=0))
    buffer = layer.keys.data_ptr()
    step = torch.randn(6, 1, 1, 8)
    keys, values = layer.update(step, -step)
    assert keys.shape == (6, 1, 5, 8) and keys.data_ptr() == buffer  # one position written, nothing copied
    assert torch.equal(keys[:, :, 4:], step) and torch.equal(values[:, :, 4:], -step)


def test_retired_rows_leave_the_others_cache_as_it_was():
    layer = GroupLayer(capacity=6, group=2)
    prefill = torch.randn(2, 1, 3, 4)
    layer.update(prefill, prefill)
    step = torch.randn(4, 1, 1, 4)
    full, _ = layer.update(step, step)
    full = full.clone()
    layer.batch_select_indices(torch.tensor([3, 1]))
    assert torch.equal(layer.keys, full[[3, 1]]) and torch.equal(layer.values, full[[3, 1]])
    nxt = torch.randn(2, 1, 1, 4)
    keys, _ = layer.update(nxt, nxt)
    assert torch.equal(keys, torch.cat([full[[3, 1]], nxt], dim=2))


def test_a_shared_layer_keeps_each_prompt_once_and_retires_into_the_per_row_layout():
    # the same steps through a shared and an unshared layer: the shared one hands the prompt once per group and the
    # rows' own part, which put together are the unshared keys; after a retirement both hold the same rows
    shared, plain = GroupLayer(capacity=7, group=2, shared=True), GroupLayer(capacity=7, group=2)
    prefill = torch.randn(2, 1, 3, 4)  # [P, K, Lp, D]
    keys, _ = shared.update(prefill, -prefill)
    plain.update(prefill, -prefill)
    assert keys is prefill and shared.get_seq_length() == 3
    for _ in range(2):
        step = torch.randn(4, 1, 1, 4)
        keys, values = shared.update(step, -step)
        full, _ = plain.update(step, -step)
    assert isinstance(keys, SharedPrefix) and keys.prompt is prefill and keys.rows.shape == (4, 1, 2, 4)
    assert torch.equal(keys.materialize(), full) and torch.equal(values.materialize(), -full)
    assert shared.get_seq_length() == plain.get_seq_length() == 5
    shared.batch_select_indices(torch.tensor([3, 0]))
    plain.batch_select_indices(torch.tensor([3, 0]))
    step = torch.randn(2, 1, 1, 4)
    keys, values = shared.update(step, -step)
    full, _ = plain.update(step, -step)
    assert not isinstance(keys, SharedPrefix) and torch.equal(keys, full) and torch.equal(values, -full)
