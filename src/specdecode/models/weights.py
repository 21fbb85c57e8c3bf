"""Weight formats: bf16, llama.cpp's block formats q8_0, q4_0, q4_1, q5_0 and q5_1, and its K-quants q4_k, q5_k
and q6_k, kept quantized in memory.

A block format holds, per output row and per block of 32 inputs, integer codes and an fp16 scale ``d`` (and
for q4_1 and q5_1 an fp16 minimum ``m``): q8_0 ``w = d * q`` (q in -127..127), q4_0 ``w = d * (q - 8)`` and
q4_1 ``w = d * q + m`` (q in 0..15), q5_0 ``w = d * (q - 16)`` and q5_1 ``w = d * q + m`` (q in 0..31); q5_0
and q5_1 are read from a GGUF file only, never quantized to. :class:`BlockWeight` is that form, unpacked:
codes, scales and minimums as tensors. It comes from a GGUF file's own blocks without a round trip
(``from_gguf``), or from float weights through the ``gguf`` package's quantizers, which are llama.cpp's
reference ones (``quantize``). ``pack`` lays it out for the kernels (``kernels/linear_quant.h``), ``unpack``
reads it back. The K-quants (Q4_K, Q5_K, Q6_K: super-blocks of 256) are ``super_blocks.SuperBlockWeight``,
read as stored and never quantized to; ``pack``, ``unpack`` and ``concat`` here take either form.

Each GGUF type has our format (``FORMAT_OF``): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K are kept as
stored; Q8_K becomes q8_0, requantized from their dequantized values, and so do the types not listed
(Q2_K, Q3_K, IQ*: more bytes than the file's); F32, F16 and BF16 tensors stay bf16. A Q8_0 tensor holding the
code -128 (llama.cpp's quantizer never writes it) is requantized too. Asked for q4_1 (``--weights q4_1``, a
draft's cheapest format), a Q4_K tensor keeps its 4-bit codes, one q4_1 block per 32-weight sub-block, with
the sub-block's scale ``d * sc`` and minimum ``-dmin * m`` rounded to fp16 (a relative error of at most 2^-11
of a block's scale, against a 4-bit step of 1/15 of its range, while they stay above fp16's smallest normal,
6.1e-5).

This module does not compute products (the kernels do) or choose the format of a model (``packing.pack``
does, with ``choose_formats``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

from specdecode.models import super_blocks
from specdecode.models.block_codecs import (Q4_K_BYTES, Q6_K_BYTES, q4_k_dequantize, q4_k_parts, q6_k_dequantize,
                                            q8_0_quantize)
from specdecode.models.super_blocks import SUPER_FORMATS, SUPER_QTYPES, SuperBlockWeight

# What --weights offers. "q4_1+head" is q4_1 with the output head in q4_1 too, not q8_0 ("q4_0+head" the same in
# q4_0): a draft model's formats (a draft's head only sets how often it is right; the 0.5B Qwen's q8_0 head is 40%
# of its bytes).
WHOLE_Q4 = "q4_1+head"
WHOLE_FORMATS = {WHOLE_Q4: "q4_1", "q4_0+head": "q4_0"}  # each whole-model request and its one format
WEIGHT_FORMATS = ("auto", "blocks", "bf16", "q8_0", "q4_0", "q4_1", *WHOLE_FORMATS)
BLOCK_FORMATS = ("q8_0", "q4_0", "q4_1")
BLOCK_REQUESTS = (*BLOCK_FORMATS, *WHOLE_FORMATS)  # the --weights that need a backend computing block formats
FORMAT_CODES = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "bf16": 3, "q4_k": 4, "q6_k": 5, "q5_k": 6,  # the kernels'
                "q5_0": 7, "q5_1": 8}  # (linear_quant.h)
BLOCK = 32
_QTYPES = {"q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "q4_1": QT.Q4_1}

# Our format for each GGUF tensor type (those read as stored, and those mapped; see the module docstring).
FORMAT_OF = {QT.Q8_0: "q8_0", QT.Q4_0: "q4_0", QT.Q4_1: "q4_1", QT.Q4_K: "q4_k", QT.Q5_0: "q5_0",
             QT.Q5_1: "q5_1", QT.Q5_K: "q5_k", QT.Q6_K: "q6_k", QT.Q8_K: "q8_0", QT.F32: "bf16", QT.F16: "bf16",
             QT.BF16: "bf16"}
# The 32-weight block format a GGUF type's blocks become code for code (``from_gguf``), no requantizing.
_CODE_FOR_CODE = {QT.Q8_0: "q8_0", QT.Q4_0: "q4_0", QT.Q4_1: "q4_1", QT.Q4_K: "q4_1", QT.Q5_0: "q5_0",
                  QT.Q5_1: "q5_1"}
# The 32-weight block format that holds each K-quant under "blocks" (``choose_formats``).
_STAND_IN = {"q4_k": "q4_1", "q5_k": "q8_0", "q6_k": "q8_0"}
_MINIMUM = ("q4_1", "q5_1")  # the formats with an fp16 minimum per block
_FIFTH_BIT = ("q5_0", "q5_1")  # codes of 5 bits: a q4 nibble plus a fifth bit


@dataclass(frozen=True)
class BlockWeight:
    """A ``[N, K]`` weight in a block format, unpacked.

    Args:
        fmt: "q8_0", "q4_0", "q4_1", "q5_0" or "q5_1".
        codes: uint8 ``[N, B * 32]``, B = ceil(K / 32): q8_0 as ``q + 128``, q4 as the nibble value 0..15, q5
            0..31 (inputs past K are zero-weighted padding).
        d: float16 ``[N, B]`` scales.
        m: float16 ``[N, B]`` minimums (q4_1, q5_1), else None.
        k: input features.
    """

    fmt: str
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.k

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[N, K]`` weights the codes stand for (what the kernels compute with)."""
        q = self.codes.float().view(self.codes.shape[0], -1, BLOCK)
        d = self.d.float()[..., None]
        if self.fmt == "q8_0":
            w = (q - 128) * d
        elif self.fmt in ("q4_0", "q5_0"):
            w = (q - (8 if self.fmt == "q4_0" else 16)) * d
        else:
            w = q * d + self.m.float()[..., None]
        return w.reshape(self.codes.shape[0], -1)[:, :self.k]

    def rows(self, index: torch.Tensor | slice) -> "BlockWeight":
        """The output rows ``index`` (a permutation or a subset), in their order."""
        return BlockWeight(self.fmt, self.codes[index], self.d[index], None if self.m is None else self.m[index], self.k)

    def pack(self, tile: int, chunk: int = 1 << 22) -> torch.Tensor:
        """The kernels' layout (``kernels/linear_quant.h``; a K-quant's: ``SuperBlockWeight.pack``): uint8
        ``[ceil(N / tile), B, record]``, record = a block of ``tile`` outputs: codes (q8_0: per group of 4 inputs,
        ``tile`` lanes of 4 bytes; q4 and q5: inputs 4p..4p+3 in the low nibbles and 16+4p.. in the high ones,
        then for q5 the fifth bits, 4 bytes per output: ``super_blocks.fifth_bits``), then ``tile`` fp16 scales,
        then ``tile`` fp16 minimums for q4_1 and q5_1. Written ``chunk`` codes at a time, so a large head needs no
        full-size temporaries. ``unpack`` reads it back."""
        n, width = self.codes.shape
        blocks = width // BLOCK
        tiles = -(-n // tile)
        nibble_bytes = tile * BLOCK // 2
        fifth = 4 * tile if self.fmt in _FIFTH_BIT else 0
        code_bytes = tile * BLOCK if self.fmt == "q8_0" else nibble_bytes + fifth
        scale_sets = [s for s in (self.d, self.m) if s is not None]
        out = torch.empty(tiles, blocks, code_bytes + 2 * tile * len(scale_sets), dtype=torch.uint8)
        step = max(1, chunk // (tile * width))  # tiles per chunk
        for t0 in range(0, tiles, step):
            t1 = min(tiles, t0 + step)
            rows = slice(t0 * tile, min(n, t1 * tile))
            pad = (t1 - t0) * tile - (rows.stop - rows.start)  # padded outputs: zero codes and scales
            codes = torch.nn.functional.pad(self.codes[rows], (0, 0, 0, pad))
            c = codes.view(t1 - t0, tile, blocks, BLOCK).permute(0, 2, 1, 3)  # [tiles, B, tile, 32]
            if self.fmt == "q8_0":
                body = c.reshape(t1 - t0, blocks, tile, 8, 4).permute(0, 1, 3, 2, 4)  # [tiles, B, quad, tile, 4]
            else:
                low = c & 0x0F
                # [tiles, B, tile, 16]: byte 4p + j holds inputs 4p + j and 16 + 4p + j
                packed = low[..., :16] | (low[..., 16:] << 4)
                body = packed.reshape(t1 - t0, blocks, tile, 4, 4).permute(0, 1, 3, 2, 4)  # [tiles, B, p, tile, 4]
                if self.fmt in _FIFTH_BIT:
                    out[t0:t1, :, nibble_bytes:code_bytes] = super_blocks.fifth_bit_bytes(c)
            out[t0:t1, :, :nibble_bytes if self.fmt != "q8_0" else code_bytes] = body.reshape(t1 - t0, blocks, -1)
            for j, scales in enumerate(scale_sets):
                s = torch.nn.functional.pad(scales[rows], (0, 0, 0, pad)).view(t1 - t0, tile, blocks).transpose(1, 2)
                at = code_bytes + 2 * tile * j
                out[t0:t1, :, at:at + 2 * tile] = s.contiguous().view(torch.uint8).reshape(t1 - t0, blocks, -1)
        return out


Blocks = BlockWeight | SuperBlockWeight  # a weight in any format the kernels compute with


@dataclass
class WeightSource:
    """A checkpoint's weights as ``packing.pack_projections`` reads them, one tensor at a time.

    Args:
        tensors: float32 tensors by HF name (for a GGUF file, read and dequantized when asked for).
        formats: our format of each stored tensor (``FORMAT_OF``); a name not in it is "bf16".
        read_blocks: ``(name, fmt)`` -> the tensor in block format ``fmt``: its own blocks where it is stored
            so, else converted; None quantizes the float tensor.
        read_float: ``(name, dtype)`` -> the tensor in ``dtype`` (a GGUF file converts it in row chunks, so no
            float32 copy of a large table is made); None converts the float32 tensor.
    """

    tensors: Mapping[str, torch.Tensor]
    formats: Mapping[str, str] = field(default_factory=dict)
    read_blocks: Callable[[str, str], Blocks] | None = None
    read_float: Callable[[str, torch.dtype], torch.Tensor] | None = None

    def format(self, name: str) -> str:
        return self.formats.get(name, "bf16")

    def blocks(self, name: str, fmt: str) -> Blocks:
        """Tensor ``name`` in block format ``fmt`` (its stored blocks where they already are, no round trip)."""
        return self.read_blocks(name, fmt) if self.read_blocks else quantize(self.tensors[name], fmt)

    def float(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor ``name`` in ``dtype``."""
        return self.read_float(name, dtype) if self.read_float else self.tensors[name].to(dtype)


def concat(parts: Sequence[Blocks]) -> Blocks:
    """Parts of one format and width stacked along the outputs (q/k/v into one projection)."""
    fmt, k = parts[0].fmt, parts[0].k
    if any(p.fmt != fmt or p.k != k for p in parts):
        raise ValueError(f"cannot stack {[(p.fmt, p.k) for p in parts]}: one format and input width needed")
    if fmt in SUPER_FORMATS:
        return super_blocks.concat(list(parts))
    m = None if parts[0].m is None else torch.cat([p.m for p in parts])
    return BlockWeight(fmt, torch.cat([p.codes for p in parts]), torch.cat([p.d for p in parts]), m, k)


def _halves(raw: np.ndarray) -> torch.Tensor:
    """fp16 values from their little-endian bytes ``[..., 2]``."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].copy())


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes -> ``[..., 32]`` codes: llama.cpp keeps input j in byte j's low nibble, 16 + j in its high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _five_bit(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 codes ``[..., 32]`` from their fifth bits ``qh [..., 4]`` (a little-endian uint32: bit j is input
    j's) and nibbles ``qs [..., 16]``."""
    bits = (np.ascontiguousarray(qh).view("<u4") >> np.arange(32, dtype=np.uint32)) & 1  # [..., 32]
    return _nibbles(qs) | (bits.astype(np.uint8) << 4)


def from_gguf(raw: np.ndarray, qtype: QT, shape: tuple[int, int]) -> BlockWeight | None:
    """A GGUF tensor's own blocks as a BlockWeight, for the types read as stored or mapped code for code
    (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K); None for the others (requantize them from their float values).

    Args:
        raw: the tensor's bytes, uint8 (any shape holding ``N * row_bytes`` bytes).
        qtype: its GGUF type.
        shape: ``(N, K)``.
    """
    n, k = shape
    blocks = raw.reshape(n, -1)
    if qtype == QT.Q8_0:
        b = blocks.reshape(n, k // BLOCK, 34)
        q = b[..., 2:].view(np.int8)
        if (q == -128).any():  # llama.cpp never writes -128 (|code| <= 127); AVX2's sign trick cannot take it
            return None
        codes = (q.astype(np.int16) + 128).astype(np.uint8).reshape(n, k)
        return BlockWeight("q8_0", torch.from_numpy(codes), _halves(b[..., :2]), None, k)
    if qtype == QT.Q4_0:
        b = blocks.reshape(n, k // BLOCK, 18)
        return BlockWeight("q4_0", torch.from_numpy(_nibbles(b[..., 2:]).reshape(n, k)), _halves(b[..., :2]), None, k)
    if qtype == QT.Q4_1:
        b = blocks.reshape(n, k // BLOCK, 20)
        codes = _nibbles(b[..., 4:]).reshape(n, k)
        return BlockWeight("q4_1", torch.from_numpy(codes), _halves(b[..., :2]), _halves(b[..., 2:4]), k)
    if qtype == QT.Q5_0:  # fp16 d, 4 bytes of fifth bits, 16 of nibbles
        b = blocks.reshape(n, k // BLOCK, 22)
        codes = _five_bit(b[..., 2:6], b[..., 6:]).reshape(n, k)
        return BlockWeight("q5_0", torch.from_numpy(codes), _halves(b[..., :2]), None, k)
    if qtype == QT.Q5_1:  # fp16 d and m, 4 bytes of fifth bits, 16 of nibbles
        b = blocks.reshape(n, k // BLOCK, 24)
        codes = _five_bit(b[..., 4:8], b[..., 8:]).reshape(n, k)
        return BlockWeight("q5_1", torch.from_numpy(codes), _halves(b[..., :2]), _halves(b[..., 2:4]), k)
    if qtype == QT.Q4_K:  # 256-weight super-blocks: fp16 d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        d, dmin, scales, mins, codes = q4_k_parts(torch.from_numpy(blocks.reshape(-1, Q4_K_BYTES)))
        scale = (d * scales.float()).reshape(n, -1).to(torch.float16)
        minimum = (-dmin * mins.float()).reshape(n, -1).to(torch.float16)
        if not (scale.isfinite().all() and minimum.isfinite().all()):
            return None  # a scale beyond fp16's range: requantize from the float values instead
        return BlockWeight("q4_1", codes.reshape(n, k), scale, minimum, k)
    return None


def quantize(weight: torch.Tensor, fmt: str) -> BlockWeight:
    """``weight`` (``[N, K]``, any float dtype) in block format ``fmt``, by llama.cpp's reference quantizer
    (the ``gguf`` package's); K is zero-padded to whole blocks."""
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"weight format {fmt!r} is not one of {', '.join(BLOCK_FORMATS)}")
    n, k = weight.shape
    w = torch.nn.functional.pad(weight.detach().float().cpu(), (0, -k % BLOCK))
    if fmt == "q8_0":  # the reference quantizer's arithmetic in torch (``block_codecs``): the same bits, faster
        codes, d = q8_0_quantize(w.reshape(-1, BLOCK))
        return BlockWeight(fmt, (codes.to(torch.int16) + 128).to(torch.uint8).reshape(n, -1), d.reshape(n, -1), None, k)
    raw = gguf_quantize(np.ascontiguousarray(w.numpy()), _QTYPES[fmt])
    out = from_gguf(raw, _QTYPES[fmt], (n, w.shape[1]))
    return BlockWeight(out.fmt, out.codes, out.d, out.m, k)


def convert(raw: np.ndarray, qtype: QT, shape: tuple[int, int], fmt: str, chunk: int = 1 << 22,
            keep: bool = True) -> Blocks:
    """A GGUF tensor in block format ``fmt``: its own blocks where its type maps to ``fmt`` code for code
    (``from_gguf``), else dequantized and requantized; ``chunk`` weights at a time either way, so that no
    full-size temporary of a large tensor (a 150k-row output head) is made.

    Args:
        raw: the tensor's bytes, uint8 (any shape holding ``N * row_bytes`` bytes).
        qtype: its GGUF type.
        shape: ``(N, K)``.
        fmt: one of BLOCK_FORMATS, or the format the tensor is stored in where nothing is quantized to it (a
            K-quant, q5_0, q5_1).
        keep: keep the stored blocks where they are in ``fmt`` (False requantizes them).

    Raises:
        ValueError: a K-quant, q5_0 or q5_1 format that is not the tensor's own (nothing converts into one).
    """
    n, k = shape
    rows, step = raw.reshape(n, -1), max(1, chunk // k)
    if fmt in SUPER_FORMATS:
        if SUPER_QTYPES[fmt] != qtype:
            raise ValueError(f"{fmt} weights come only from {SUPER_QTYPES[fmt].name} tensors, not {qtype.name}")
        return super_blocks.read_chunked(rows, qtype, (n, k), step)
    if fmt in _FIFTH_BIT and _CODE_FOR_CODE.get(qtype) != fmt:
        raise ValueError(f"{fmt} weights come only from {fmt.upper()} tensors, not {qtype.name}")
    width = -(-k // BLOCK)
    out = BlockWeight(fmt, torch.empty(n, width * BLOCK, dtype=torch.uint8), torch.empty(n, width, dtype=torch.float16),
                      torch.empty(n, width, dtype=torch.float16) if fmt in _MINIMUM else None, k)
    own = keep and _CODE_FOR_CODE.get(qtype) == fmt
    for i in range(0, n, step):
        part_shape = (min(step, n - i), k)
        part = from_gguf(rows[i:i + step], qtype, part_shape) if own else None
        if own and part is None:  # a block the format cannot keep as it is: the whole tensor is requantized
            return convert(raw, qtype, shape, fmt, chunk, keep=False)
        if part is None:
            part = quantize(dequantized(rows[i:i + step], qtype, part_shape), fmt)
        out.codes[i:i + step], out.d[i:i + step] = part.codes, part.d
        if part.m is not None:
            out.m[i:i + step] = part.m
    return out


def dequantized(raw: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 values of a GGUF tensor's bytes (``raw`` uint8 ``[..., row_bytes]``): Q4_K and Q6_K by
    ``block_codecs``, other types by the ``gguf`` package (the same bits either way).

    Raises:
        NotImplementedError: a type the ``gguf`` package cannot dequantize.
    """
    if qtype in _TORCH_DECODERS:
        size, decode = _TORCH_DECODERS[qtype]
        return decode(torch.from_numpy(np.ascontiguousarray(raw).reshape(-1, size))).reshape(shape)
    return torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, qtype), dtype=np.float32).reshape(shape))


_TORCH_DECODERS = {QT.Q4_K: (Q4_K_BYTES, q4_k_dequantize), QT.Q6_K: (Q6_K_BYTES, q6_k_dequantize)}


def choose_formats(requested: str, stored: Sequence[str], head: bool = False) -> list[str]:
    """The format of each part of one projection (its parts stored as ``stored``, e.g. q, k and v) under
    ``--weights``.

    "auto" keeps each part's own format, K-quants, q5_0 and q5_1 included. Parts in different formats (a Q4_K_M
    file's Q4_K q and k beside a Q6_K v) are then each computed in their own (``linear.SplitLinear``), as
    llama.cpp computes them; where a part is stored unquantized, every part is bf16. "blocks" takes every K-quant
    as the block format that holds it (``_STAND_IN``: Q4_K's codes as q4_1, Q5_K and Q6_K requantized to q8_0:
    cheaper verification rows, see ``kernels/linear_kquant.h``). An explicit block format applies to every part as
    asked, except that the output head (``head``) is kept at least q8_0 under q4 formats, as llama.cpp's quantizer
    keeps it wider; "q4_1+head" and "q4_0+head" (``WHOLE_FORMATS``) are that format for the head too.
    """
    if requested in WHOLE_FORMATS:
        return [WHOLE_FORMATS[requested]] * len(stored)
    if requested == "blocks":  # the K-quants as 32-weight formats; the rest as "auto" takes them
        stored = [_STAND_IN[s] if s in SUPER_FORMATS else s for s in stored]
    if requested in ("auto", "blocks"):
        return ["bf16"] * len(stored) if "bf16" in stored else list(stored)
    if requested in ("q4_0", "q4_1") and head:
        return ["q8_0"] * len(stored)
    return [requested] * len(stored)


def unpack(packed: torch.Tensor, fmt: str, n: int, k: int, tile: int) -> Blocks:
    """The weight that ``BlockWeight.pack`` or ``SuperBlockWeight.pack`` turned into ``packed`` (padding dropped)."""
    if fmt in SUPER_FORMATS:
        return SuperBlockWeight.unpack(packed, fmt, n, k, tile)
    tiles, blocks, _ = packed.shape
    nibble_bytes = tile * 16
    code_bytes = tile * 32 if fmt == "q8_0" else nibble_bytes + (4 * tile if fmt in _FIFTH_BIT else 0)
    if fmt == "q8_0":
        body = packed[..., :code_bytes]
        c = body.reshape(tiles, blocks, 8, tile, 4).permute(0, 1, 3, 2, 4).reshape(tiles, blocks, tile, BLOCK)
    else:
        body = packed[..., :nibble_bytes]
        b = body.reshape(tiles, blocks, 4, tile, 4).permute(0, 1, 3, 2, 4).reshape(tiles, blocks, tile, 16)
        c = torch.cat([b & 0x0F, b >> 4], dim=-1)
        if fmt in _FIFTH_BIT:
            c = c | (super_blocks.fifth_bits(packed[..., nibble_bytes:code_bytes], tile) << 4)
    codes = c.permute(0, 2, 1, 3).reshape(tiles * tile, blocks * BLOCK)[:n]

    def scales(at: int) -> torch.Tensor:
        s = packed[..., at:at + 2 * tile].contiguous().view(torch.float16)  # [tiles, B, tile]
        return s.transpose(1, 2).reshape(tiles * tile, blocks)[:n]

    return BlockWeight(fmt, codes.contiguous(), scales(code_bytes),
                       scales(code_bytes + 2 * tile) if fmt in _MINIMUM else None, k)
