"""llama.cpp block formats decoded and encoded with torch ops, bitwise as the ``gguf`` package's numpy
reference does it (the same float32 operations in the same order; tests/models/test_block_codecs.py checks
every one against it), and several times faster on a model's worth of blocks: Q4_K and Q6_K decoded to
float32, and split into their codes and sub-block scales (and Q4_K's minimums), float32 encoded as Q8_0.

Only the formats a load converts in bulk are here; ``weights.py`` uses them where it can and the ``gguf``
package everywhere else. Nothing here packs for a kernel or reads a file.
"""

from __future__ import annotations

import torch

QK_K = 256  # weights per K-quant super-block
Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES = 144, 176, 210


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """float32 of little-endian fp16 values stored in ``raw [..., 2]`` uint8."""
    return raw.contiguous().view(torch.float16).float()


def q4_k_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks ``raw [S, 144]`` uint8 -> ``d``, ``dmin`` float32 ``[S, 1]``, the 6-bit scales and
    minimums uint8 ``[S, 8]`` (one per 32 weights) and the 4-bit codes uint8 ``[S, 256]`` in weight order."""
    s = raw.shape[0]
    d, dmin = _f16(raw[:, 0:2]), _f16(raw[:, 2:4])
    packed = raw[:, 4:16].reshape(s, 3, 4)
    lo, mid, hi = packed[:, 0], packed[:, 1], packed[:, 2]  # [S, 4] each
    scales = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)
    mins = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=-1)
    qs = raw[:, 16:].reshape(s, 4, 1, 32)  # 4 chunks of 64 weights: low nibbles, then high nibbles
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(s, QK_K)
    return d, dmin, scales, mins, codes


def q5_k_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_K super-blocks ``raw [S, 176]`` (Q4_K's fields with 32 bytes of high bits before the nibbles) -> as
    ``q4_k_parts``, the codes 0..31: weight 32b + i takes bit b of high byte i."""
    s = raw.shape[0]
    d, dmin, scales, mins, low = q4_k_parts(torch.cat([raw[:, :16], raw[:, 48:]], dim=1))
    high = torch.stack([(raw[:, 16:48] >> b) & 1 for b in range(8)], dim=1).reshape(s, QK_K)  # [S, 8 x 32]
    return d, dmin, scales, mins, low | (high << 4)


def q4_k_dequantize(raw: torch.Tensor) -> torch.Tensor:
    """Q4_K super-blocks ``raw [S, 144]`` -> float32 ``[S, 256]``: ``d * scale * q - dmin * min``."""
    d, dmin, scales, mins, codes = q4_k_parts(raw)
    s = raw.shape[0]
    step = (d * scales.float()).reshape(s, 8, 1)
    low = (dmin * mins.float()).reshape(s, 8, 1)
    return (step * codes.reshape(s, 8, 32).float() - low).reshape(s, QK_K)


def q6_k_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K super-blocks ``raw [S, 210]`` (128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales,
    fp16 d) -> ``d`` float32 ``[S, 1]``, the scales int8 ``[S, 16]`` (one per 16 weights) and the 6-bit codes
    uint8 ``[S, 256]`` (0..63, the weight plus 32) in weight order."""
    s = raw.shape[0]
    ql, qh = raw[:, :128], raw[:, 128:192]
    scales = raw[:, 192:208].contiguous().view(torch.int8)
    low = torch.stack([ql.reshape(s, 2, 64) >> shift for shift in (0, 4)], dim=2) & 0x0F  # [S, 2, 2, 64]
    high = torch.stack([qh.reshape(s, 2, 32) >> shift for shift in (0, 2, 4, 6)], dim=2) & 0x03  # [S, 2, 4, 32]
    codes = low.reshape(s, 8, 32) | (high.reshape(s, 8, 32) << 4)
    return _f16(raw[:, 208:210]), scales, codes.reshape(s, QK_K)


def q6_k_dequantize(raw: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks ``raw [S, 210]`` -> float32 ``[S, 256]``: ``d * scale * (q - 32)``."""
    d, scales, codes = q6_k_parts(raw)
    s = raw.shape[0]
    step = (d * scales.float()).reshape(s, 16, 1)
    q = codes.to(torch.int8) - 32
    return (step * q.reshape(s, 16, 16).float()).reshape(s, QK_K)


def q8_0_quantize(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``blocks [M, 32]`` -> Q8_0 codes int8 ``[M, 32]`` and fp16 scales ``[M]``, as llama.cpp's
    reference quantizer: ``d = max|w| / 127``, codes rounded half away from zero."""
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    x = blocks * inverse
    a = x.abs()
    floored = a.floor()  # the reference's rounding step by step (x + 0.5 would round 0.49999997 up to 1)
    q = torch.sign(x) * (floored + (2 * (a - floored)).floor())
    return q.to(torch.int8), d[:, 0].half()
