"""llama.cpp's K-quant formats kept as stored: q4_k (GGUF Q4_K), q5_k (Q5_K) and q6_k (Q6_K), super-blocks of
256 weights.

q4_k: ``w = (d * sc_j) * q - (dmin * m_j)``, q in 0..15, 6-bit sc_j and m_j per 32 weights, fp16 d and dmin
per super-block; q5_k: the same with q in 0..31; q6_k: ``w = (d * sc_h) * (q - 32)``, q in 0..63, an int8 sc_h per 16 weights, fp16 d.
:class:`SuperBlockWeight` is that form unpacked: codes and scales as tensors, read from a GGUF tensor's bytes
(``from_gguf``), packed for the kernels (``kernels/linear_kquant.h``) by ``pack`` and read back by ``unpack``.
Its ``dequantize`` is bitwise the ``gguf`` package's dequantization of the same blocks.

Nothing here quantizes float weights into these formats (no quantizer of ours writes them: a K-quant weight
comes only from a file that stores it) or computes products.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as QT

from specdecode.models.block_codecs import (Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, QK_K, q4_k_parts, q5_k_parts,
                                            q6_k_parts)

SUPER_FORMATS = ("q4_k", "q5_k", "q6_k")
SUPER_QTYPES = {"q4_k": QT.Q4_K, "q5_k": QT.Q5_K, "q6_k": QT.Q6_K}
BLOCK = 32
_SUB = {"q4_k": 32, "q5_k": 32, "q6_k": 16}  # weights per sub-block scale
_RECORD = {"q4_k": 148, "q5_k": 180, "q6_k": 210}  # packed bytes per output and super-block
_MINS = ("q4_k", "q5_k")  # the formats with minimums (dmin, m_j)


@dataclass(frozen=True)
class SuperBlockWeight:
    """A ``[N, K]`` weight in a K-quant format, unpacked (K a multiple of 256).

    Args:
        fmt: "q4_k", "q5_k" or "q6_k".
        codes: uint8 ``[N, K]``: q4_k 0..15, q5_k 0..31, q6_k 0..63 (the weight's code plus 32).
        scales: the sub-block scales: q4_k / q5_k uint8 ``[N, K / 32]`` (6-bit), q6_k int8 ``[N, K / 16]``.
        mins: q4_k's / q5_k's 6-bit minimums uint8 ``[N, K / 32]``; None for q6_k.
        d: float16 ``[N, K / 256]`` super-block scales.
        dmin: float16 ``[N, K / 256]`` super-block scales of the minimums (q4_k, q5_k), else None.
    """

    fmt: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    d: torch.Tensor
    dmin: torch.Tensor | None

    @property
    def k(self) -> int:
        return self.codes.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.k

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[N, K]`` weights, bitwise as the ``gguf`` package dequantizes the stored blocks."""
        n, k = self.shape
        sub = _SUB[self.fmt]
        d = self.d.float().repeat_interleave(QK_K // sub, dim=1)  # [N, K / sub]
        step = (d * self.scales.float())[..., None]
        if self.fmt in _MINS:
            dmin = self.dmin.float().repeat_interleave(QK_K // sub, dim=1)
            low = (dmin * self.mins.float())[..., None]
            return (step * self.codes.view(n, -1, sub).float() - low).reshape(n, k)
        q = self.codes.to(torch.int8) - 32
        return (step * q.view(n, -1, sub).float()).reshape(n, k)

    def rows(self, index: torch.Tensor | slice) -> "SuperBlockWeight":
        """The output rows ``index`` (a permutation or a subset), in their order."""
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return SuperBlockWeight(self.fmt, self.codes[index], self.scales[index], pick(self.mins), self.d[index],
                                pick(self.dmin))

    def pack(self, tile: int, chunk: int = 1 << 22) -> torch.Tensor:
        """The kernels' layout (``kernels/linear_kquant.h``): uint8 ``[ceil(N / tile), K / 256, record]``,
        written ``chunk`` codes at a time."""
        n, k = self.shape
        supers, tiles = k // QK_K, -(-n // tile)
        out = torch.empty(tiles, supers, _RECORD[self.fmt] * tile, dtype=torch.uint8)
        step = max(1, chunk // (tile * k))
        for t0 in range(0, tiles, step):
            t1 = min(tiles, t0 + step)
            rows = slice(t0 * tile, min(n, t1 * tile))
            pad = (t1 - t0) * tile - (rows.stop - rows.start)  # padded outputs: zero codes and scales

            def tiled(t: torch.Tensor) -> torch.Tensor:  # [rows, X] -> [tiles, tile, X], zero padded
                return torch.nn.functional.pad(t[rows], (0, 0, 0, pad)).view(t1 - t0, tile, -1)

            out[t0:t1] = _pack_tiles(self.fmt, tiled(self.codes), tiled(self.scales),
                                     None if self.mins is None else tiled(self.mins), tiled(self.d),
                                     None if self.dmin is None else tiled(self.dmin))
        return out

    @classmethod
    def unpack(cls, packed: torch.Tensor, fmt: str, n: int, k: int, tile: int) -> "SuperBlockWeight":
        """The weight that ``pack`` turned into ``packed`` (padding dropped)."""
        tiles, supers, _ = packed.shape
        rec = packed.view(tiles, supers, -1)

        def per_output(t: torch.Tensor) -> torch.Tensor:  # [tiles, S, width, tile] -> [N, S * width]
            return t.permute(0, 3, 1, 2).reshape(tiles * tile, -1)[:n].contiguous()

        def halfs(at: int) -> torch.Tensor:
            return per_output(rec[..., at:at + 2 * tile].contiguous().view(torch.float16)[:, :, None])

        if fmt in _MINS:
            width = 18 if fmt == "q4_k" else 22  # q5_k: 4 T bytes of high bits after the nibbles
            blocks = rec[..., 4 * tile:].reshape(tiles, supers, 8, width * tile)
            codes = _nibble_codes(blocks[..., :16 * tile], tile)  # [tiles, S, 8, tile, 32]
            if fmt == "q5_k":
                codes = codes | (fifth_bits(blocks[..., 16 * tile:20 * tile], tile) << 4)
            codes = per_output(codes.permute(0, 1, 2, 4, 3).reshape(tiles, supers, 8 * BLOCK, tile))
            at = (width - 2) * tile
            scales = per_output(blocks[..., at:at + tile].contiguous())
            mins = per_output(blocks[..., at + tile:].contiguous())
            return cls(fmt, codes, scales, mins, halfs(0), halfs(2 * tile))
        blocks = rec[..., 2 * tile:].reshape(tiles, supers, 8, 26 * tile)
        low = _nibble_codes(blocks[..., :16 * tile], tile)  # [tiles, S, 8, tile, 32]
        pairs = blocks[..., 16 * tile:24 * tile].reshape(tiles, supers, 8, 2, tile, 4)  # bits 2p: input 16h+4p+i
        high = torch.stack([(pairs >> (2 * p)) & 3 for p in range(4)], dim=5)  # [.., h, tile, p, i]
        high = high.permute(0, 1, 2, 4, 3, 5, 6).reshape(tiles, supers, 8, tile, BLOCK)
        codes = per_output((low | (high << 4)).permute(0, 1, 2, 4, 3).reshape(tiles, supers, 8 * BLOCK, tile))
        scales = per_output(blocks[..., 24 * tile:].contiguous().view(torch.int8).reshape(tiles, supers, 16, tile))
        return cls(fmt, codes, scales, None, halfs(0), None)


def _nibble_codes(body: torch.Tensor, tile: int) -> torch.Tensor:
    """q4-arranged bytes ``[..., 16 * tile]`` (vector (p, lane): inputs 4p..4p+3 low, 16+4p.. high) -> codes
    ``[..., tile, 32]``."""
    b = body.reshape(*body.shape[:-1], 4, tile, 4).transpose(-3, -2).reshape(*body.shape[:-1], tile, 16)
    return torch.cat([b & 0x0F, b >> 4], dim=-1)


def fifth_bits(body: torch.Tensor, tile: int) -> torch.Tensor:
    """The fifth bits' bytes ``[..., 4 * tile]`` of q5_k, q5_0 and q5_1 (per output 4 bytes, byte i: bit p =
    input 4p + i, bit 4 + p = input 16 + 4p + i) -> bits ``[..., tile, 32]``."""
    b = body.reshape(*body.shape[:-1], tile, 4)  # [..., tile, i]
    bits = torch.stack([(b >> shift) & 1 for shift in range(8)], dim=-2)  # [..., tile, 8 (h p), i]
    return bits.reshape(*body.shape[:-1], tile, BLOCK)  # input 16h + 4p + i


def fifth_bit_bytes(codes: torch.Tensor) -> torch.Tensor:
    """5-bit codes ``[..., tile, 32]`` -> their fifth bits' bytes ``[..., 4 * tile]`` (see ``fifth_bits``)."""
    bits = (codes >> 4).reshape(*codes.shape[:-1], 8, 4)  # [..., tile, (h p), i]
    packed = sum(bits[..., shift, :] << shift for shift in range(8))  # [..., tile, i]
    return packed.reshape(*codes.shape[:-2], 4 * codes.shape[-2])


def _nibble_body(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., tile, 32]`` (< 16) -> the q4 arrangement ``[..., 16 * tile]``."""
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # [..., tile, 16]
    lead, tile = packed.shape[:-2], packed.shape[-2]
    return packed.reshape(*lead, tile, 4, 4).transpose(-3, -2).reshape(*lead, 16 * tile)


def _pack_tiles(fmt: str, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, d: torch.Tensor,
                dmin: torch.Tensor | None) -> torch.Tensor:
    """Records of whole tiles: codes ``[tiles, tile, K]``, scales / mins ``[tiles, tile, K / sub]``, d / dmin
    ``[tiles, tile, S]`` -> uint8 ``[tiles, S, record]``."""
    tiles, tile, k = codes.shape
    supers = k // QK_K
    c = codes.view(tiles, tile, supers, 8, BLOCK).permute(0, 2, 3, 1, 4)  # [tiles, S, 8, tile, 32]

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [tiles, tile, S * 8 * m] -> [tiles, S, 8, m * tile] bytes
        t = t.contiguous().view(torch.uint8)
        return t.view(tiles, tile, supers, 8, -1).permute(0, 2, 3, 4, 1).reshape(tiles, supers, 8, -1)

    def halves(t: torch.Tensor) -> torch.Tensor:  # fp16 [tiles, tile, S] -> [tiles, S, 2 * tile] bytes
        return t.transpose(1, 2).contiguous().view(torch.uint8).reshape(tiles, supers, 2 * tile)

    if fmt in _MINS:
        high = [fifth_bit_bytes(c)] if fmt == "q5_k" else []  # [tiles, S, 8, 4 tile]
        blocks = torch.cat([_nibble_body(c & 0x0F), *high, per_block(scales), per_block(mins)], dim=-1)
        return torch.cat([halves(d), halves(dmin), blocks.reshape(tiles, supers, -1)], dim=-1)
    low = _nibble_body(c & 0x0F)  # [tiles, S, 8, 16 * tile]
    high = (c >> 4).reshape(tiles, supers, 8, tile, 2, 4, 4)  # [.., tile, h, p, i]
    pairs = sum(high[..., p, :] << (2 * p) for p in range(4))  # [.., tile, h, i]
    pairs = pairs.permute(0, 1, 2, 4, 3, 5).reshape(tiles, supers, 8, 8 * tile)  # [.., h, tile, i]
    blocks = torch.cat([low, pairs, per_block(scales)], dim=-1)  # [tiles, S, 8, 26 tile]
    return torch.cat([halves(d), blocks.reshape(tiles, supers, -1)], dim=-1)


def from_gguf(raw: np.ndarray, qtype: QT, shape: tuple[int, int]) -> SuperBlockWeight:
    """A Q4_K, Q5_K or Q6_K tensor's own blocks (``raw`` uint8, ``N * row_bytes`` bytes; ``shape`` ``(N, K)``)."""
    n, k = shape
    if qtype in (QT.Q4_K, QT.Q5_K):
        size, parts = (Q4_K_BYTES, q4_k_parts) if qtype == QT.Q4_K else (Q5_K_BYTES, q5_k_parts)
        d, dmin, scales, mins, codes = parts(torch.from_numpy(np.ascontiguousarray(raw).reshape(-1, size)))
        return SuperBlockWeight("q4_k" if qtype == QT.Q4_K else "q5_k", codes.reshape(n, k), scales.reshape(n, -1),
                                mins.reshape(n, -1), d.reshape(n, -1).half(), dmin.reshape(n, -1).half())
    if qtype == QT.Q6_K:
        d, scales, codes = q6_k_parts(torch.from_numpy(np.ascontiguousarray(raw).reshape(-1, Q6_K_BYTES)))
        return SuperBlockWeight("q6_k", codes.reshape(n, k), scales.reshape(n, -1), None, d.reshape(n, -1).half(), None)
    raise ValueError(f"{qtype.name} is not a K-quant kept as stored ({', '.join(q.name for q in SUPER_QTYPES.values())})")


def read_chunked(rows: np.ndarray, qtype: QT, shape: tuple[int, int], step: int) -> SuperBlockWeight:
    """``from_gguf`` of a tensor's rows (``rows`` uint8 ``[N, row bytes]``) ``step`` rows at a time, into tensors
    allocated once: a large head needs no second full-size copy."""
    n, k = shape
    first = from_gguf(rows[:step], qtype, (min(step, n), k))

    def whole(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.empty(n, t.shape[1], dtype=t.dtype)

    out = SuperBlockWeight(first.fmt, whole(first.codes), whole(first.scales), whole(first.mins), whole(first.d),
                           whole(first.dmin))
    for i in range(0, n, step):
        part = first if i == 0 else from_gguf(rows[i:i + step], qtype, (min(step, n - i), k))
        for name in ("codes", "scales", "mins", "d", "dmin"):
            if getattr(out, name) is not None:
                getattr(out, name)[i:i + step] = getattr(part, name)
    return out


def concat(parts: list[SuperBlockWeight]) -> SuperBlockWeight:
    """Parts of one format and width stacked along the outputs."""
    pick = lambda name: None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])  # noqa: E731
    return SuperBlockWeight(parts[0].fmt, pick("codes"), pick("scales"), pick("mins"), pick("d"), pick("dmin"))
