"""Linear layers for CPU decoding: bf16 weights pre-packed once (our kernels or oneDNN), block-quantized
weights on our kernels, or int8 weight-only.

``NativeLinear`` runs one of our compiled kernels (see ``native.py``): ``tiled`` (AVX512-BF16 dot
products, ``kernels/linear_bf16.h``) or ``avx512`` / ``avx2`` (bf16 widened to fp32 in registers,
fp32 FMAs, the same header). Weights stream once per call whatever the row count, and each
row's result is bitwise independent of the rows beside it. On an AVX512-BF16 CPU the tiled kernel makes
a SmolLM2 decode step ~1.4x and a Qwen 1.5B step ~2x cheaper than oneDNN, whose 1-row bf16 path reaches
about half the memory bandwidth. Their sums run in another order than ``F.linear``'s, so their numbers
differ from oneDNN's in the last bits (within bf16 rounding); the avx512 and avx2 builds agree bitwise.

``F.linear`` on a CPU in bf16 reorders the whole weight matrix into oneDNN's blocked layout on every
call; for the 1-17 rows of a decode or verification step that reorder costs more than the product
itself (a SmolLM2 gate/up projection: 122 us plain, 55 us pre-packed). Packing once at load time
gives bitwise the same results as ``F.linear`` in bf16 (tests/models/test_linear.py checks it).

``QuantLinear`` keeps weights in llama.cpp's q8_0 / q4_0 / q4_1 / q5_0 / q5_1 blocks or its K-quants q4_k /
q5_k / q6_k as stored (``weights.py``, ``super_blocks.py``) and multiplies int8-quantized rows of x with them
(``kernels/linear_quant.h``, ``linear_kquant.h``): each row's integer block sums are exact,
so rows are bitwise independent of each other, and every build gives the same bits.

``SplitLinear`` is one projection whose parts (q and k, then v) are ``QuantLinear`` layers in formats of their
own, as a GGUF stores them.

``Int8Linear`` stores weights as int8 with one scale per output row and multiplies with torch's
int8 weight-only kernel: half the bytes of bf16 to stream per step, and different numbers. It is
meant for draft models, whose output only has to be a good guess (verification keeps the result
exact); a target quantized this way is a different model.

Each layer answers for itself: its formats (``formats``) and, where it keeps a readable copy, its weight rows
(``weight_rows``, the output head's rows a draft vocabulary scores with).

This module does not choose between kernels (``backends/`` do, and ``packing.py`` swaps these layers in);
packed layers cannot be saved, moved to another device or trained.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from specdecode.models import native
from specdecode.models.weights import FORMAT_CODES, Blocks, unpack as unpack_blocks


def can_pack(weight: torch.Tensor) -> bool:
    """True where a oneDNN pre-packed copy of ``weight`` can be made (CPU, bf16, oneDNN built in, and a
    CPU it packs bf16 for: AVX512BW/VL/DQ or AVX-NE-CONVERT; not an AVX2-only one)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


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

    def weight_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Refused: oneDNN's blocked layout is opaque, no readable copy of the weight is kept."""
        raise ValueError("this layer is packed for oneDNN, which keeps no readable copy of its weights; load the "
                         "model with --linear torch or one of our kernels")

    @property
    def formats(self) -> list[str]:
        return ["bf16"]  # can_pack takes bf16 weights only

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


class NativeLinear(nn.Module):
    """``y = x W^T + b`` with one of our compiled kernels (``native.kernel(path)`` must not be None).

    Args:
        weight: ``[out_features, in_features]``, CPU bf16.
        bias: ``[out_features]`` or None.
        path: a build of ``native.BUILDS``: "tiled", "avx512" or "avx2".
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, path: str = "tiled") -> None:
        super().__init__()
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            raise ValueError(f"the {path} kernel needs a CPU bf16 weight, got {weight.dtype} on {weight.device}")
        self._setup(native.pack(weight, native.BUILDS[path].tile), *weight.shape, bias, path)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, out_features: int, in_features: int, bias: torch.Tensor | None,
                    path: str) -> "NativeLinear":
        """A layer over a weight already in this kernel's layout (``packed``, as a saved layer held it)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(packed, out_features, in_features, bias, path)
        return layer

    def _setup(self, packed: torch.Tensor, out_features: int, in_features: int, bias: torch.Tensor | None,
               path: str) -> None:
        ops = native.kernel(path)
        if ops is None:
            raise RuntimeError(f"the {path} kernel is unavailable: {native.unavailable_reason(path)}")
        self.path = path
        self._op = getattr(ops, native.BUILDS[path].bf16_linear)
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("packed", packed)  # [N/T, K/2, T, 2]
        self.bias = None if bias is None else nn.Parameter(bias.detach().contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.packed, self.out_features, self.bias)

    def weight_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The bf16 weight rows ``[len(rows), in_features]`` this layer was built from."""
        return native.unpack(self.packed, self.out_features, self.in_features)[rows]

    @property
    def weight_format(self) -> str:
        return "bf16"

    @property
    def formats(self) -> list[str]:
        return [self.weight_format]

    def proj(self):
        """This layer as the fused layer's projection (``kernels/layer.h``): the same packed weight."""
        bias = None if self.bias is None else self.bias.float().contiguous()
        return native.kernel(self.path).Proj(self.packed, FORMAT_CODES["bf16"], self.out_features, self.in_features, bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.path}")


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with W in a block format, computed by our kernel of ``path`` on int8-quantized rows.

    Args:
        weight: the ``[out_features, in_features]`` weight in a block format or a K-quant (``weights.Blocks``).
        bias: ``[out_features]`` (kept in fp32) or None.
        path: a build of ``native.BUILDS``: "tiled", "avx512" or "avx2".
    """

    def __init__(self, weight: Blocks, bias: torch.Tensor | None = None, path: str = "avx2") -> None:
        super().__init__()
        self._setup(weight.pack(native.BUILDS[path].quant_tile), weight.fmt, *weight.shape, bias, path)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, fmt: str, out_features: int, in_features: int,
                    bias: torch.Tensor | None, path: str) -> "QuantLinear":
        """A layer over blocks already in this kernel's layout (``packed``, as a saved layer held it)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(packed, fmt, out_features, in_features, bias, path)
        return layer

    def _setup(self, packed: torch.Tensor, fmt: str, out_features: int, in_features: int,
               bias: torch.Tensor | None, path: str) -> None:
        ops = native.kernel(path)
        if ops is None:
            raise RuntimeError(f"the {path} kernel is unavailable: {native.unavailable_reason(path)}")
        self.path, self.fmt, self._ops = path, fmt, ops
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("packed", packed)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.quant_linear(x, self.packed, FORMAT_CODES[self.fmt], self.out_features, self.bias)

    def blocks(self) -> Blocks:
        """The weight in its block format, as packed."""
        return unpack_blocks(self.packed, self.fmt, self.out_features, self.in_features, native.BUILDS[self.path].quant_tile)

    def block_rows(self, rows: torch.Tensor) -> Blocks:
        """The weight rows ``rows`` in their block format, unpacked from the tiles that hold them only (a
        151936-row head unpacks whole in 0.3 s)."""
        tile = native.BUILDS[self.path].quant_tile
        tiles = torch.unique(rows // tile)  # sorted
        part = unpack_blocks(self.packed[tiles], self.fmt, len(tiles) * tile, self.in_features, tile)
        return part.rows(torch.searchsorted(tiles, rows // tile) * tile + rows % tile)

    def weight_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The weight rows ``[len(rows), in_features]`` as the kernel computes with them, in float32."""
        return self.block_rows(rows).dequantize()

    @property
    def weight_format(self) -> str:
        return self.fmt

    @property
    def formats(self) -> list[str]:
        return [self.fmt]

    def proj(self):
        """This layer as the fused layer's projection (``kernels/layer.h``): the same packed weight."""
        return self._ops.Proj(self.packed, FORMAT_CODES[self.fmt], self.out_features, self.in_features, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.fmt} on {self.path}")


class SplitLinear(nn.Module):
    """One projection whose parts, its outputs in order, are ``QuantLinear`` layers in formats of their own (a
    GGUF's Q4_K q and k beside its Q6_K v): ``y = cat([part(x) for part in parts])``, each part computed as it is
    alone, so rows stay bitwise independent. The fused layer computes every part's tiles in one pass over the
    same prepared inputs (``kernels/layer.h``, a ``Proj`` of parts).

    Args:
        parts: layers over the same inputs, on one kernel build.
    """

    def __init__(self, parts: Sequence[QuantLinear]) -> None:
        super().__init__()
        if len({(p.in_features, p.path) for p in parts}) != 1:
            raise ValueError(f"a split projection's parts read the same inputs on one kernel build, not "
                             f"{[(p.in_features, p.path) for p in parts]}")
        self.parts = nn.ModuleList(parts)
        self.in_features, self.path = parts[0].in_features, parts[0].path
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    @property
    def formats(self) -> list[str]:
        return [part.fmt for part in self.parts]

    def proj(self):
        """This layer as the fused layer's projection: one ``Proj`` over the parts' packed weights."""
        return self.parts[0]._ops.Proj([part.proj() for part in self.parts])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{'+'.join(self.formats)} on {self.path}")


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

    def weight_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows ``rows`` of ``dequantized()`` ``[len(rows), in_features]``, in float32."""
        return self.qweight[rows].float() * self.scale[rows].float()[:, None]

    @property
    def formats(self) -> list[str]:
        return ["int8"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # the kernel takes [M, in]
        y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scale).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias

