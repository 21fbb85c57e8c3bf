"""block_codecs: every torch codec gives bitwise what the gguf package's numpy reference gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from specdecode.models.block_codecs import Q4_K_BYTES, Q6_K_BYTES, q4_k_dequantize, q6_k_dequantize, q8_0_quantize
from specdecode.models.weights import dequantized, quantize as our_quantize


def random_blocks(size: int, n: int, seed: int, halves: list[int]) -> np.ndarray:
    """``n`` random super-blocks of ``size`` bytes whose fp16 fields at byte offsets ``halves`` are finite."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at in halves:
        raw[:, at:at + 2] = rng.normal(0, 0.05, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    raw[0, halves[0]:halves[0] + 2] = 0  # a zero scale
    return raw


@pytest.mark.parametrize("qtype, size, halves, decode", [
    (QT.Q4_K, Q4_K_BYTES, [0, 2], q4_k_dequantize),
    (QT.Q6_K, Q6_K_BYTES, [208], q6_k_dequantize),
])
def test_k_quants_decode_as_gguf(qtype, size, halves, decode):
    raw = random_blocks(size, 300, seed=int(qtype), halves=halves)
    want = dequantize(raw, qtype).reshape(300, 256)
    got = decode(torch.from_numpy(raw))
    assert got.dtype == torch.float32 and np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))
    # and through weights.dequantized, rows of several super-blocks
    rows = dequantized(raw.reshape(100, -1), qtype, (100, 768))
    assert np.array_equal(rows.numpy(), want.reshape(100, 768))


def test_q8_0_encodes_as_gguf():
    rng = np.random.default_rng(0)
    w = rng.normal(0, 1, (64, 96)).astype(np.float32)
    w[0, :32] = 0  # an all-zero block
    w[2, 5] = 1e30  # one huge weight
    w[3, :32] = [127] + [k + 0.5 * (-1) ** k for k in range(-15, 16)]  # d = 1: exact halves round away from zero
    w[4, :4] = [127, np.float32(0.49999997), -np.float32(0.49999997), np.float32(1.4999999)]  # just below halves
    codes, d = q8_0_quantize(torch.from_numpy(w).reshape(-1, 32))
    with np.errstate(over="ignore", invalid="ignore"):  # the reference's own fp16 overflow of the huge block
        ref = quantize(w, QT.Q8_0).reshape(-1, 34)
        want = dequantize(ref.reshape(64, -1), QT.Q8_0)
    assert np.array_equal(d.numpy().view(np.uint8).reshape(-1, 2), ref[:, :2])
    assert np.array_equal(codes.numpy().view(np.uint8), ref[:, 2:])
    blocks = our_quantize(torch.from_numpy(w), "q8_0")
    assert np.array_equal(blocks.dequantize().numpy(), want, equal_nan=True)
