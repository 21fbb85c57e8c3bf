"""Packing a model's projections for a backend: every fused projection and the output head swapped for the
backend's packed copy, in bf16, a block format (q8_0, q4_0, q4_1; q5_0, q5_1 as stored) or a K-quant as stored
(q4_k, q5_k, q6_k), chosen per part of a projection (``weights.choose_formats``: parts stored in different
formats, such as q and k beside v, each keep theirs in a ``SplitLinear``), read from a GGUF's stored blocks
where they already are in that format, else quantized from the float weights. Also int8 weight-only
quantization (draft models: ``pack`` on ``backends.INT8``) and the description of a model's weight formats.

A tied output head keeps the embedding table for lookups and gains a packed copy. This module takes a resolved
``Backend``: it does not choose one (``build.pack_model`` and ``build.load_model`` resolve a ``--linear`` name,
once), does not build the model (``build.py``) and does not run anything.
"""

from __future__ import annotations

from itertools import groupby
from typing import Callable, NamedTuple, Sequence

import torch
from torch import nn

from specdecode.models.backends import AUTO, Backend
from specdecode.models.backends.base import block_formats_refused
from specdecode.models.hf_import import head_part, projection_parts
from specdecode.models.linear import QuantLinear, SplitLinear
from specdecode.models.weights import BLOCK_REQUESTS, WEIGHT_FORMATS, WeightSource, choose_formats, concat, quantize

PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")


class _HeadView(NamedTuple):
    """A tied output head seen as a bias-free linear layer over the embedding table."""

    weight: torch.Tensor
    bias: None = None


def check_repack(model, kernel: str, weights: str) -> None:
    """Refuses to pack an already packed (or quantized) ``model`` again for another backend or other weights.

    Args:
        model: a packed ``Transformer``.
        kernel: the ``--linear`` name asked for ("auto" accepts the current backend).
        weights: the format asked for ("auto" accepts the current one).
    """
    current = model.backend.name
    same_weights = weights in (AUTO, model.packed_as, model.weight_format)
    if not same_weights:
        raise ValueError(f"the projections are already packed with {model.weight_format} weights on {current}; "
                         f"cannot repack them as {weights}")
    if kernel not in (AUTO, current):
        raise ValueError(f"the projections already run on {current}; cannot switch to {kernel}")


def pack(model, backend: Backend, weights: str = AUTO, source: WeightSource | None = None,
         log: Callable[[str], None] | None = None, fuse: bool = True) -> None:
    """Moves an unpacked ``model`` onto ``backend``: every projection swapped for its packed copy, bf16 or a block
    format, and the layers readied to run there. On a backend that packs nothing (torch) only the format is
    checked: the model stays movable and can be packed later.

    Args:
        model: a ``Transformer`` whose projections are its own ``nn.Linear`` layers (or unfilled, with ``source``).
        backend: where the projections will run (``backends.INT8``: int8 weight-only copies).
        weights: one of WEIGHT_FORMATS: "bf16", a block format for every projection (the output head at least
            q8_0 but under "q4_1+head", see ``weights.choose_formats``), "auto": as ``source`` stores them where
            the backend computes block formats (the GGUF's own blocks, K-quants included), else bf16, or "blocks":
            as "auto" with the K-quants in 32-weight block formats.
        source: the checkpoint's float weights and stored formats (``Checkpoint.weights``); without it, block
            formats are quantized from the model's own weights.
        log: told how far packing has come (see ``pack_projections``).
        fuse: run each layer as one kernel call where the backend can (False keeps one torch op per step, to
            measure the difference).

    Raises:
        ValueError: an unknown format, one the backend cannot compute, or a model already packed.
    """
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {weights!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    if model.head_layer is not None:
        raise ValueError(f"the projections are already packed or quantized (on {model.backend.name})")
    if weights in BLOCK_REQUESTS and not backend.block_formats:
        raise block_formats_refused(weights, backend)
    if backend.packs:
        pack_projections(model, backend, weights if backend.block_formats else "bf16", source, log)
        adopt(model, backend, weights, fuse)


def adopt(model, backend: Backend, weights: str, fuse: bool = True) -> None:
    """Readies ``model``'s layers to run on ``backend``, whose packed copies its projections already are (packed
    by ``pack``, or read back by ``packed_cache``); ``weights`` is the format they were packed as asked for."""
    model.packed_as = weights if backend.block_formats else "bf16"  # "auto" off block formats: bf16
    model.backend, model.runner = backend, backend.prepare(model.layers, model.rope, model, fuse)


def pack_projections(model, backend: Backend, weights: str, source: WeightSource | None,
                     log: Callable[[str], None] | None = None) -> None:
    """Swaps each projection of ``model`` (and its output head) for ``backend``'s packed copy.

    Args:
        model: an unpacked ``Transformer``.
        backend: where the projections will run.
        weights: "bf16" or a block format for every projection (the output head at least q8_0), or "auto":
            as ``source`` stores them, K-quants included (block formats only where ``backend.block_formats``),
            or "blocks": as "auto" with the K-quants in 32-weight block formats (``weights.choose_formats``).
        source: the checkpoint's weights and stored formats, read one projection at a time (the model's own
            projection weights are then not read and may be unfilled, on the meta device); without it, the
            model's own weights are packed.
        log: told how far packing has come, every quarter of the layers, where it takes a while (a GGUF read
            and converted into another format).
    """
    def make(layer: nn.Module, parts: list[str], head: bool) -> nn.Module:
        formats = choose_formats(weights, [source.format(f"{p}.weight") for p in parts] if source else ["bf16"], head)
        fmt = formats[0]
        bias = layer.bias
        if bias is not None and source is not None:  # the checkpoint's fp32 biases, not the bf16 copies
            bias = torch.cat([source.tensors[f"{p}.bias"] for p in parts])
        if len(set(formats)) > 1:
            return _split(backend, source, parts, formats, bias)
        if source is None:
            if fmt == "bf16":
                return backend.linear(layer.weight, bias)
            return backend.block_linear(quantize(layer.weight, fmt), bias)
        # one projection's weights read from the checkpoint at a time: the model's own may never have been filled
        if fmt == "bf16":
            return backend.linear(torch.cat([source.float(f"{p}.weight", model.dtype) for p in parts]), bias)
        return backend.block_linear(concat([source.blocks(f"{p}.weight", fmt) for p in parts]), bias)

    swap_projections(model, make, log if source is not None else None)


def _split(backend: Backend, source: WeightSource, parts: Sequence[str], formats: Sequence[str],
           bias: torch.Tensor | None) -> SplitLinear:
    """A projection whose parts keep formats of their own: each run of neighbouring parts in one format (q and k,
    then v) packed as one layer."""
    layers, first = [], 0
    for fmt, run in groupby(zip(parts, formats), key=lambda part: part[1]):
        blocks = concat([source.blocks(f"{p}.weight", fmt) for p, _ in run])
        n = blocks.shape[0]
        layers.append(backend.block_linear(blocks, None if bias is None else bias[first:first + n]))
        first += n
    return SplitLinear(layers)


def swap_projections(model, make: Callable[[nn.Module, list[str], bool], nn.Module],
                     log: Callable[[str], None] | None = None) -> None:
    """Replaces each projection of ``model`` by ``make(layer, its checkpoint names, is the output head)``,
    telling ``log`` after each quarter of the layers. The output head goes first: its temporaries (a 150k-row
    head's codes beside its packed copy) then come while little else is resident, which bounds the peak."""
    head = model.lm_head or _HeadView(model.embed.weight)
    model.head_layer, model.lm_head = make(head, [head_part(model.config)], True), None
    n = len(model.layers)
    marks = {max(1, n * q // 4) for q in (1, 2, 3)}
    for i, block in enumerate(model.layers):
        for name, parts in projection_parts(i).items():
            setattr(block, name, make(getattr(block, name), parts, False))
        if log is not None and i + 1 in marks:
            log(f"packed {i + 1}/{n} layers")


def weight_format(model) -> str:
    """``model``'s projection formats, e.g. "bf16", "q4_1" or "q4_1+q8_0, head q8_0" (the head named where it
    differs); "int8" for int8 weight-only copies; the model dtype ("float32", ...) for unpacked weights."""
    if model.head_layer is None:  # unpacked: the model's own nn.Linear projections, in the model dtype
        return {torch.bfloat16: "bf16"}.get(model.dtype, str(model.dtype).replace("torch.", ""))
    layers = sorted({f for b in model.layers for n in PROJECTIONS for f in getattr(b, n).formats})
    head = "+".join(model.head_layer.formats)
    text = "+".join(layers) or head
    return text if layers == [head] or not layers else f"{text}, head {head}"


def block_weights(model) -> bool:
    """Whether ``model``'s output head computes with a block format (its projections were packed in one)."""
    return isinstance(model.head_layer, QuantLinear)

