"""Linear layers for CPU decoding: weights pre-packed once for oneDNN, or int8 weight-only.

``F.linear`` on a CPU in bf16 reorders the whole weight matrix into oneDNN's blocked layout on every
call; for the 1-17 rows of a decode or verification step that reorder costs more than the product
itself (a SmolLM2 gate/up projection: 122 us plain, 55 us pre-packed). Packing once at load time
gives bitwise the same results as ``F.linear`` in bf16 (tests/models/test_linear.py checks it).

``Int8Linear`` stores weights as int8 with one scale per output row and multiplies with torch's
int8 weight-only kernel: half the bytes of bf16 to stream per step, and different numbers. It is
meant for draft models, whose output only has to be a good guess (verification keeps the result
exact); a target quantized this way is a different model.

This module does not fuse or choose kernels beyond those switches; the packed weight is an opaque
oneDNN tensor, so a packed layer cannot be saved, moved to another device or trained.
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


class Int8Linear(nn.Module):
    """``y = x (s * Q)^T + b`` with Q int8 ``[out, in]`` and s one scale per output row (symmetric).

    Args:
        weight: ``[out_features, in_features]`` float weight to quantize.
        bias: ``[out_features]`` or None (kept in the activation dtype).
        dtype: activation dtype the layer will be called with.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [out]
        self.register_buffer("qweight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def dequantized(self) -> torch.Tensor:
        """The float weight this layer computes with, ``s * Q`` (for tests and error bounds)."""
        return self.qweight.float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # the kernel takes [M, in]
        y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scale).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias

