"""Linear layers whose float32 weights are also held in MKL's packed GEMM layout, for a CPU rollout's decode steps.

A plain float32 linear layer on a CPU hands MKL's GEMM the weight as it is, and the GEMM lays it out for its kernel at
every call. A decode step calls every layer with the same number of rows (the running rows), so the weight can be
laid out once per rollout (`cblas_sgemm_pack`, torch's `mkl._mkl_reorder_linear_weight`) and each call multiplies
by the packed weight (`mkl._mkl_linear`): the same products, with less time per matmul. The layout depends on the
number of rows, so a layer holds it for one row count; inputs with any other (the prefill, the steps after rows
retire) run the plain linear.
"""

from __future__ import annotations

import torch
from torch import Tensor


def packing_available() -> bool:
    """True when this torch has MKL (x86 builds; not ARM ones), whose packed GEMM the layers use."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


class PackedLinear(torch.nn.Linear):
    """`nn.Linear` whose forward uses a packed copy of its weight for inputs of `rows` rows (set by `pack_linears`).

    The weight stays the layer's parameter (tied weights stay tied, refreshing copies into it); the packed copy is
    a buffer outside the state dict, made again whenever the weight or the row count changes.
    """

    packed: Tensor | None = None
    rows: int = 0

    def forward(self, input: Tensor) -> Tensor:
        if self.packed is not None and input.numel() == self.rows * self.in_features:
            return torch.ops.mkl._mkl_linear(input, self.packed, self.weight, self.bias, self.rows)
        return super().forward(input)


def use_packed_linears(model: torch.nn.Module) -> list[PackedLinear]:
    """Make every plain float32 CPU `nn.Linear` of `model` a `PackedLinear` (in place, no copy); returns them."""
    layers = []
    for module in model.modules():
        if type(module) is torch.nn.Linear and _cpu_float32(module.weight):
            module.__class__ = PackedLinear  # the same module and parameters, a forward that reads the packed weight
            layers.append(module)
    return layers


@torch.no_grad()
def pack_linears(layers: list[PackedLinear], rows: int | None) -> None:
    """Lay out each layer's current weight for inputs of `rows` rows; None drops the packed weights."""
    for layer in layers:
        layer.packed = None if rows is None else torch.ops.mkl._mkl_reorder_linear_weight(layer.weight, rows)
        layer.rows = rows or 0


def _cpu_float32(weight: Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.device.type == "cpu"
