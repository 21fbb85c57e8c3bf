"""The backends that run on torch's own kernels: ``torch`` (``F.linear``, any device: the GPU path),
``onednn`` (bf16 weights pre-packed once in oneDNN's layout, CPU) and ``int8`` (int8 weight-only
projections, for draft models; ``packing.pack`` on ``INT8``).

None of them is row-invariant: their matmuls round a one-row product differently from a multi-row one, so
callers that need a verification forward to reproduce decoding give every forward at least two rows.
Attention runs on ``attention.rowwise_attention``. This module holds no compiled kernels of ours
(``backends/compiled.py``) and chooses no backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from specdecode.models.backends.base import EagerLayers, LayerRunner, OutputHead, block_formats_refused
from specdecode.models.block import Block
from specdecode.models.linear import Int8Linear, PackedLinear, can_pack
from specdecode.models.rope import Rope
from specdecode.models.weights import Blocks


def plain_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A frozen ``nn.Linear`` holding ``weight`` and ``bias`` (no copy), on their device and dtype."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return layer


class _TorchLayers:
    """What the torch-op backends share: no block formats, rows that depend on the row count, eager layers."""

    name: str
    row_invariant = False
    block_formats = False
    packs = True

    def synchronize(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def block_linear(self, weight: Blocks, bias: torch.Tensor | None) -> nn.Module:
        raise block_formats_refused(weight.fmt, self)

    def prepare(self, blocks: Sequence[Block], rope: Rope, output: OutputHead | None,
                fuse: bool = True) -> LayerRunner:
        for block in blocks:
            block.attention_ops = None
        return EagerLayers(blocks, rope, output)


@dataclass(frozen=True)
class TorchBackend(_TorchLayers):
    """Projections on ``F.linear`` (plain ``nn.Linear``), on any device and dtype; packing changes nothing."""

    name: str = "torch"
    packs = False

    def problem(self, dtype: torch.dtype, device: torch.device,
                log: Callable[[str], None] | None = None) -> str | None:
        return None

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        return plain_linear(weight, bias)


@dataclass(frozen=True)
class OneDnnBackend(_TorchLayers):
    """bf16 projections pre-packed in oneDNN's blocked layout (``linear.PackedLinear``): bitwise F.linear's
    results without its per-call reorder of the weight."""

    name: str = "onednn"

    def problem(self, dtype: torch.dtype, device: torch.device,
                log: Callable[[str], None] | None = None) -> str | None:
        if dtype != torch.bfloat16 or device.type != "cpu":
            return f"the {self.name} kernel needs a bf16 model on the CPU (this one is {dtype} on {device})"
        if not can_pack(torch.empty(0, dtype=dtype)):
            return "oneDNN cannot pack bf16 weights for this CPU or torch build"
        return None

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        return PackedLinear(weight, bias)


@dataclass(frozen=True)
class Int8Backend(_TorchLayers):
    """int8 weight-only projections (``linear.Int8Linear``, torch's int8 kernel): half the bytes of bf16 per
    step and different numbers; a model quantized this way is a different model (meant for drafts)."""

    name: str = "int8"

    def problem(self, dtype: torch.dtype, device: torch.device,
                log: Callable[[str], None] | None = None) -> str | None:
        return None

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        return Int8Linear(weight, bias, weight.dtype)
