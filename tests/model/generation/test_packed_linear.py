"""Linear layers multiplying by MKL-packed weights: the plain layer's outputs, for the packed row count and any
other, and the packed path really taken."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from interleave_model.generation.packed_linear import PackedLinear, pack_linears, packing_available, use_packed_linears

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no MKL (packed GEMM)")


def _no_plain_forward(monkeypatch) -> None:
    def refuse(self, input):
        raise AssertionError("the plain linear ran for the packed row count")

    monkeypatch.setattr(torch.nn.Linear, "forward", refuse)


@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_layer_gives_the_plain_layers_outputs(bias, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 80, bias=bias), torch.nn.ReLU(), torch.nn.Linear(80, 16, bias=bias))
    inputs = {rows: torch.randn(rows, 1, 48) for rows in (6, 5, 40)}  # decode-shaped [rows, 1, in]
    expected = {rows: model(x) for rows, x in inputs.items()}
    layers = use_packed_linears(model)
    assert len(layers) == 2 and all(isinstance(layer, PackedLinear) for layer in layers)
    pack_linears(layers, rows=6)
    for rows, x in inputs.items():  # 6 rows through the packed weights, 5 and 40 through the plain layer
        torch.testing.assert_close(model(x), expected[rows], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(model(inputs[6].view(6, 48)), expected[6].view(6, 16), atol=1e-6, rtol=1e-6)  # 2-D
    with monkeypatch.context() as patched:
        _no_plain_forward(patched)
        torch.testing.assert_close(model(inputs[6]), expected[6], atol=1e-6, rtol=1e-6)
        with pytest.raises(AssertionError, match="plain linear"):
            model(inputs[5])
    pack_linears(layers, rows=None)  # unpacked: the plain layer for every row count
    _no_plain_forward(monkeypatch)
    with pytest.raises(AssertionError, match="plain linear"):
        model(inputs[6])


def test_packing_converts_float32_linears_in_place_and_keeps_parameters_and_ties():
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(10, 8), "head": torch.nn.Linear(8, 10, bias=False),
                                 "narrow": torch.nn.Linear(8, 8).to(torch.bfloat16)})  # fmt: skip
    model["head"].weight = model["embed"].weight  # tied, as many language models' heads are
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    layers = use_packed_linears(model)
    assert layers == [model["head"]]  # the bfloat16 layer stays plain: MKL packs float32 only
    assert type(model["narrow"]) is torch.nn.Linear
    assert [name for name, _ in model.named_parameters(remove_duplicate=False)] == names
    assert model["head"].weight is model["embed"].weight
    pack_linears(layers, rows=3)
    x = torch.randn(3, 8)
    with torch.no_grad():
        model["embed"].weight.add_(1.0)  # the tied weight changes: the packed copy is stale until packed again
        stale = model["head"](x)
        pack_linears(layers, rows=3)
        torch.testing.assert_close(model["head"](x), F.linear(x, model["embed"].weight), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(stale, model["head"](x), atol=1e-3)
