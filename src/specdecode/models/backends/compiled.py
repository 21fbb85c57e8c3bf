"""Our compiled CPU kernels as a backend (``models/native.py`` builds them): bf16 or block-format projections
(``linear.NativeLinear``, ``linear.QuantLinear``, ``linear.SplitLinear`` of parts in formats of their own), our row-invariant attention, and each layer of a forward as
one fused C++ call (``kernels/layer.h``: RMSNorm, projections, RoPE, the cache write, attention and the MLP,
with an fp32 residual stream).

Every projection computes each row bitwise the same whatever shares its call, so the backend is
row-invariant: one verification forward reproduces token-by-token decoding exactly. A plain bf16 cache's
buffers are written inside the kernel (all layers of a forward in one call, cut only after layers whose
outputs are kept); a cache that must see every write (compressing, recording) gets the new keys/values
through ``Cache.update`` in the layer's three-part form, with the same numbers.

This module does not compile anything (``models/native.py``) or choose a build (``backends/__init__.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Sequence

import torch
from torch import nn

from specdecode.kv.cache import Cache
from specdecode.models import native
from specdecode.models.backends.base import EagerLayers, LayerRunner, OutputHead
from specdecode.models.block import Block
from specdecode.models.linear import NativeLinear, QuantLinear
from specdecode.models.rope import Rope
from specdecode.models.rows import RowPlan
from specdecode.models.weights import Blocks


@dataclass(frozen=True)
class NativeBackend:
    """One build of our kernels (``native.BUILDS``: "tiled", "avx512" or "avx2"), named as the build is."""

    name: str
    row_invariant = True
    block_formats = True
    packs = True

    def problem(self, dtype: torch.dtype, device: torch.device,
                log: Callable[[str], None] | None = None) -> str | None:
        if dtype != torch.bfloat16 or device.type != "cpu":
            return f"the {self.name} kernel needs a bf16 model on the CPU (this one is {dtype} on {device})"
        reason = native.unavailable_reason(self.name, log)
        return None if reason is None else f"the {self.name} kernel is unavailable: {reason}"

    def synchronize(self, device: torch.device) -> None:
        """Nothing to wait for: our kernels return when their work is done."""

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        return NativeLinear(weight, bias, self.name)

    def block_linear(self, weight: Blocks, bias: torch.Tensor | None) -> nn.Module:
        return QuantLinear(weight, bias, self.name)

    def prepare(self, blocks: Sequence[Block], rope: Rope, output: OutputHead | None,
                fuse: bool = True) -> LayerRunner:
        ops = native.kernel(self.name)
        for block in blocks:
            block.attention_ops = ops  # also what the blocks' own forwards attend with
        return FusedLayers(ops, blocks, rope, output) if fuse else EagerLayers(blocks, rope, output)


def fused_layer(ops: ModuleType, block: Block) -> Any:
    """``block`` as one kernel object (``native`` Layer) over its packed projections' weights."""
    return ops.Layer(block.wqkv.proj(), block.wo.proj(), block.w_gate_up.proj(), block.w_down.proj(),
                     block.attn_norm, block.mlp_norm, block.eps, block.heads, block.kv_heads, block.head_dim,
                     block.q_norm, block.k_norm, block.window or 0, block.scale, int(block.activation),
                     block.post_attn_norm, block.post_mlp_norm)


class FusedLayers:
    """Layers run as one kernel call each (several per call over a plain cache), with an fp32 residual stream.

    Args:
        ops: the build's compiled module.
        blocks: the layers, their projections packed as ``NativeLinear``, ``QuantLinear`` or ``SplitLinear`` of that
            build.
        rope: the model's RoPE tables.
        output: the model's output end (its head packed likewise), or None.
    """

    fused = True

    def __init__(self, ops: ModuleType, blocks: Sequence[Block], rope: Rope, output: OutputHead | None) -> None:
        self.ops, self.rope, self.output = ops, rope, output
        self.layers = [fused_layer(ops, b) for b in blocks]  # read every forward: a plain list
        self.blocks = list(blocks)
        self.head = None if output is None else output.head_layer.proj()
        self._all = range(len(self.layers))

    def run(self, x: torch.Tensor, cache: Cache, plan: RowPlan, run: Sequence[int],
            keep: Sequence[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        dtype, x = x.dtype, x.float()  # [N, hidden]: the residual stream in fp32
        cos, sin = self.rope.rows(plan.length)  # [K, P, D/2]
        cos, sin = cos.unbind(0), sin.unbind(0)  # K views [P, D/2]: one each, not one per layer (~0.6 us a view)
        kinds = [self.rope.kind[i] for i in run]
        kept: dict[int, torch.Tensor] = {}
        buffers = cache.direct_buffers(run, plan.slots, plan.starts, plan.counts)
        if buffers is None:
            for i, kind in zip(run, kinds):
                x = self._through_update(i, x, cache, plan, (cos[kind], sin[kind], plan.positions))
                if i in keep:
                    kept[i] = x.to(dtype)
            return x, kept
        kernels = self.layers if run == self._all else [self.layers[i] for i in run]
        # runs of layers in one kernel call each, cut after every layer whose output is kept: no return to
        # Python (and no idle threads) between the layers of a run
        cuts = [0, len(run)] if not keep else \
            [0] + [j + 1 for j, i in enumerate(run) if i in keep and j + 1 < len(run)] + [len(run)]
        trees = [None if seen is None else list(seen) for seen in plan.trees]
        coss, sins = [cos[k] for k in kinds], [sin[k] for k in kinds]
        for a, b in zip(cuts, cuts[1:]):
            x = self.ops.layers_rows(kernels[a:b], x, coss[a:b], sins[a:b], plan.positions, buffers[0][a:b],
                                     buffers[1][a:b], list(plan.slots), plan.starts, list(plan.counts), trees)
            if run[b - 1] in keep:
                kept[run[b - 1]] = x.to(dtype)
        return x, kept

    def _through_update(self, i: int, x: torch.Tensor, cache: Cache, plan: RowPlan,
                        rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Layer ``i`` in three calls around ``Cache.update`` (for a cache that must see each write), over the
        fp32 rows ``x [N, hidden]``."""
        layer, block = self.layers[i], self.blocks[i]
        q, k, v = self.ops.layer_qkv(layer, x, *rope)  # q [N, H, D] fp32, k/v [1, Hkv, N, D] bf16
        attn = x.new_empty(x.shape[0], block.heads * block.head_dim)
        offset = 0
        for slot, start, n, seen in zip(plan.slots, plan.starts, plan.counts, plan.trees):
            keys, values = cache.update(i, (slot,), (start,), k[:, :, offset:offset + n], v[:, :, offset:offset + n])
            self.ops.layer_attend(layer, q, offset, n, keys, values, *(seen or (None, None)), attn)
            offset += n
        return self.ops.layer_finish(layer, x, attn)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm_rows(x.contiguous(), self.output.norm, self.output.config.rms_norm_eps)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.ops.project_rows(self.head, normed.contiguous())
