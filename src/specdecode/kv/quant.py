"""Asymmetric min/max integer quantization of K/V tensors: codes, scales and zero points.

Each group of values is mapped to integer codes ``0..2^bits - 1`` with ``x ~ code * scale + zero``,
``zero = min(group)`` and ``scale = (max - min) / (2^bits - 1)``, so the rounding error of any element
is at most ``scale / 2`` (plus float rounding). int4 codes are packed two per byte along the last
dimension. Scales and zero points are float32: a float16 zero point would round by more than an int8
step for channels with a large offset and a small range (the outlier channels KIVI groups keys for).

Which dimension forms a group is the caller's choice (``compressed.py``: keys per channel over a block of
tokens, values per token over the head dimension). This module holds no state and knows nothing about
caches, positions or verification.
"""

from __future__ import annotations

import torch

SCALE_DTYPE = torch.float32
_TINY = 1e-12  # floor of a scale, so that a constant group does not divide by zero (its codes are all 0)


def levels(bits: int) -> int:
    """The largest code of a ``bits``-bit quantizer."""
    if bits not in (4, 8):
        raise ValueError(f"quantization supports 4 or 8 bits, got {bits}")
    return (1 << bits) - 1


def packed_width(width: int, bits: int) -> int:
    """Bytes that ``width`` codes of ``bits`` bits occupy along the packed dimension."""
    if bits == 4 and width % 2:
        raise ValueError(f"int4 packs two codes per byte: the packed dimension must be even, got {width}")
    return width * bits // 8


def quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantizes ``x`` with one scale and zero point per slice along ``dim``.

    Args:
        x: values (any float dtype; computed in float32).
        bits: 8 or 4.
        dim: the dimension reduced by min/max (the group); it keeps size 1 in the scales.

    Returns:
        ``(codes, scale, zero)``: uint8 codes shaped like ``x`` except the last dimension, packed to
        :func:`packed_width`; float32 scale and zero shaped like ``x`` with ``dim`` of size 1.
    """
    top = levels(bits)
    x = x.float()
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((hi - lo) / top).clamp_min(_TINY)
    codes = ((x - lo) / scale).round_().clamp_(0, top).to(torch.uint8)
    return pack(codes, bits), scale, lo


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
               dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``unpack(codes) * scale + zero`` in float32, returned as ``dtype``."""
    return torch.addcmul(zero, unpack(codes, bits).float(), scale).to(dtype)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes -> bytes: unchanged for 8 bits; pairs along the last dimension for 4 bits (low nibble first)."""
    if bits == 8:
        return codes
    packed_width(codes.shape[-1], bits)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`."""
    if bits == 8:
        return packed
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
