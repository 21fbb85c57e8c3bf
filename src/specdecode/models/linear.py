"""Linear layers with weights pre-packed once for oneDNN (CPU).

``F.linear`` on a CPU in bf16 reorders the whole weight matrix into oneDNN's blocked layout on every
call; for the 1-17 rows of a decode or verification step that reorder costs more than the product
itself (a SmolLM2 gate/up projection: 122 us plain, 55 us pre-packed). Packing once at load time
gives bitwise the same results as ``F.linear`` in bf16 (tests/models/test_linear.py checks it).

This module does not quantize, fuse or choose kernels beyond that one switch; the packed weight is an
opaque oneDNN tensor, so a packed layer cannot be saved, moved to another device or trained.
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(weight: torch.Tensor) -> bool:
    """True where a oneDNN pre-packed copy of ``weight`` can be made (CPU, bf16, oneDNN built in)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W held in oneDNN's blocked layout.

    Args:
        weight: ``[out_features, in_features]``, CPU bf16 (see ``can_pack``).
        bias: ``[out_features]`` or None.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if not can_pack(weight):
            raise ValueError(f"cannot pack a {weight.dtype} weight on {weight.device} (needs CPU bf16 with oneDNN)")
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.numel() * weight.element_size()  # the packed copy is opaque; same element count
        # batch-size hint 1: the decode-step shape; the layout is the same for every row count we run.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> "PackedLinear":
        return cls(layer.weight, layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def linear_nbytes(layer: nn.Module) -> int:
    """Bytes of a linear layer's weight and bias, packed or not."""
    if isinstance(layer, PackedLinear):
        return layer.nbytes + (0 if layer.bias is None else layer.bias.numel() * layer.bias.element_size())
    return sum(p.numel() * p.element_size() for p in layer.parameters())
