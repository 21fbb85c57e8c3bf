"""What a backend is: the protocol every way of running the model's projections and layers follows
(:class:`Backend`), the runner it returns for a stack of layers (:class:`LayerRunner`), and the runner of the
backends that run each layer as torch ops (:class:`EagerLayers`).

A backend packs projections for its kernels, says whether its rows are row-invariant (a row's result the same
whatever else shares the forward), waits for its device before a timer is read, and runs layers over the rows
of a ragged forward. The maths of the model (which layers, which rows, what comes back) stays in
``transformer.py``; this module holds no kernels and chooses no backend (``backends/__init__.py`` does).
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.kv.cache import Cache
from specdecode.models.block import Block
from specdecode.models.config import ModelConfig
from specdecode.models.rope import Rope
from specdecode.models.rows import RowPlan
from specdecode.models.weights import Blocks


class OutputHead(Protocol):
    """What a runner reads of a model's output end (a ``Transformer`` is one): the final RMSNorm's weight,
    the output head, and its packed projection."""

    config: ModelConfig
    norm: torch.Tensor  # [hidden]
    head_layer: nn.Module | None  # the packed output projection; None before packing

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Normed states ``[..., hidden]`` -> logits ``[..., V]`` in the model dtype."""


class LayerRunner(Protocol):
    """A stack of layers as one backend runs them over the rows of a ragged forward.

    ``fused``: each layer runs as one kernel call, in the ragged form only (the residual stream in fp32);
    otherwise the layers are the blocks' own torch modules, which also run batched ``[B, T]`` forwards.
    """

    fused: bool

    def run(self, x: torch.Tensor, cache: Cache, plan: RowPlan, run: Sequence[int],
            keep: Sequence[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Runs the layers ``run`` (in order) over the rows ``x [N, hidden]`` (embeddings in the model dtype),
        writing their keys/values into ``cache`` as ``plan`` places them (the slots' lengths are left to the
        caller). Returns the residual stream ``[N, hidden]`` (in the runner's precision) and the outputs of
        the layers in ``keep``, ``{layer: [N, hidden]}`` in the model dtype."""

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm of the residual stream ``[..., hidden]``, in the runner's precision."""

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[..., V]`` of normed rows ``[..., hidden]``."""


class Backend(Protocol):
    """One way of running the model's projections and layers.

    Attributes:
        name: what ``--linear`` (or ``--quantize``) calls it and reports show: "tiled", "onednn", "torch", ...
        row_invariant: every projection computes a row the same at any row count, so one forward's rows
            equal what separate forwards give, whatever the split (our kernels). oneDNN and F.linear round a
            one-row matmul (GEMV) differently from a multi-row one (GEMM).
        block_formats: it computes with llama.cpp's block formats (q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k,
            q6_k), not only bf16.
        packs: packing swaps the projections for copies laid out for it; False: the model's own ``nn.Linear``
            modules run as they are (the model stays movable between devices).
    """

    name: str
    row_invariant: bool
    block_formats: bool
    packs: bool

    def problem(self, dtype: torch.dtype, device: torch.device,
                log: Callable[[str], None] | None = None) -> str | None:
        """Why it cannot run a ``dtype`` model on ``device`` here, or None (asking may compile our kernels,
        which ``log`` is told about)."""

    def synchronize(self, device: torch.device) -> None:
        """Waits for the work queued on ``device``, so that a timer read next sees it (CUDA runs asynchronously)."""

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        """``y = x W^T + b`` of a float ``[out, in]`` weight, packed for this backend."""

    def block_linear(self, weight: Blocks, bias: torch.Tensor | None) -> nn.Module:
        """``y = x W^T + b`` of a block-format weight (only where ``block_formats``)."""

    def prepare(self, blocks: Sequence[Block], rope: Rope, output: OutputHead | None,
                fuse: bool = True) -> LayerRunner:
        """Readies ``blocks`` (their projections packed by this backend) to run here and returns their runner.

        Args:
            blocks: the layers, in order (a runner's layer i is ``blocks[i]``).
            rope: the model's RoPE tables.
            output: the model's output end, or None for a stack without one (a draft head's layer).
            fuse: run each layer as one kernel call where this backend can (False: one torch op per step).
        """


def block_formats_refused(fmt: str, backend: Backend) -> ValueError:
    """The error of a backend without block formats asked for ``fmt`` weights."""
    return ValueError(f"{fmt} weights need one of our kernels (a backend that computes block formats); the "
                      f"projections of this model run on {backend.name}")


class EagerLayers:
    """Layers run as their blocks' torch modules: ``Block.forward_rows`` per layer, RoPE from model-dtype tables.

    Args:
        blocks: the layers, in order.
        rope: the model's RoPE tables.
        output: the model's output end, or None.
    """

    fused = False

    def __init__(self, blocks: Sequence[Block], rope: Rope, output: OutputHead | None) -> None:
        self.blocks = list(blocks)  # a plain list: indexed every layer of every forward
        self.rope, self.output = rope, output

    def run(self, x: torch.Tensor, cache: Cache, plan: RowPlan, run: Sequence[int],
            keep: Sequence[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        cos_table, sin_table = self.rope.tables(plan.length, x.dtype)  # [K, P, D]
        cos, sin = cos_table[:, plan.positions][:, None, :, None], sin_table[:, plan.positions][:, None, :, None]
        x = x[None]  # [1, N, hidden]; cos/sin [K, 1, N, 1, D]
        kept = {}
        for i in run:
            kind = self.rope.kind[i]
            x = self.blocks[i].forward_rows(x, i, cache, plan, cos[kind], sin[kind])
            if i in keep:
                kept[i] = x[0]
        return x[0], kept

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.output.norm.to(x.dtype), self.output.config.rms_norm_eps)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.output.head(normed).float()
