"""Quantization math: error bounds for int8/int4, packing, degenerate groups, argument checks."""

from __future__ import annotations

import pytest
import torch

from specdecode.kv.quant import dequantize, levels, pack, packed_width, quantize, unpack


def _keys(tokens: int = 32, heads: int = 2, dim: int = 16, seed: int = 0) -> torch.Tensor:
    """``[H, T, D]`` with an outlier channel (large offset, small spread), as real keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(heads, tokens, dim, generator=g)
    x[:, :, 3] = 40.0 + 0.1 * x[:, :, 3]
    return x


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dim", [1, 2])  # per channel over tokens (keys), per token over channels (values)
def test_error_is_at_most_half_a_step(bits, dim):
    x = _keys()
    codes, scale, zero = quantize(x, bits, dim=dim)
    back = dequantize(codes, scale, zero, bits, torch.float32)
    step = (x.amax(dim, keepdim=True) - x.amin(dim, keepdim=True)) / levels(bits)
    assert torch.equal(scale, step.clamp_min(1e-12))
    err = (back - x).abs()
    assert (err <= step / 2 + 1e-5 * x.abs().amax()).all()
    # The bound is tight: rounding really does cost up to half a step somewhere.
    assert (err / step).max() > 0.4
    # Extremes of each group are reproduced (min exactly, max up to float rounding).
    torch.testing.assert_close(back.amin(dim), x.amin(dim), rtol=0, atol=0)
    torch.testing.assert_close(back.amax(dim), x.amax(dim), rtol=1e-6, atol=1e-4)


def test_per_channel_groups_keep_an_outlier_channel_from_spoiling_the_others():
    """Keys per channel (KIVI's choice): a token-wise group would stretch its range over the outlier's offset."""
    x = _keys()
    normal = [c for c in range(x.shape[-1]) if c != 3]
    per_channel = dequantize(*quantize(x, 4, dim=1), 4, torch.float32)
    per_token = dequantize(*quantize(x, 4, dim=2), 4, torch.float32)
    channel_err = (per_channel - x)[..., normal].abs().mean()
    token_err = (per_token - x)[..., normal].abs().mean()
    assert channel_err * 4 < token_err


def test_int4_error_is_larger_than_int8_error():
    x = _keys(seed=1)
    err = {bits: (dequantize(*quantize(x, bits, dim=1), bits, torch.float32) - x).abs().mean() for bits in (8, 4)}
    assert err[8] * 8 < err[4]


def test_constant_group_is_exact_and_codes_fit_their_bits():
    x = torch.full((1, 8, 4), 2.5)
    codes, scale, zero = quantize(x, 4, dim=1)
    assert torch.equal(dequantize(codes, scale, zero, 4, torch.float32), x)
    y = _keys()
    for bits in (8, 4):
        codes = unpack(quantize(y, bits, dim=1)[0], bits)
        assert codes.dtype == torch.uint8 and int(codes.max()) == levels(bits) and int(codes.min()) == 0


def test_dequantize_returns_the_asked_dtype():
    x = _keys()
    out = dequantize(*quantize(x.bfloat16(), 8, dim=1), 8, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape


def test_int4_packs_two_codes_per_byte_and_unpacks_exactly():
    codes = torch.arange(16, dtype=torch.uint8).repeat(3, 2)  # [3, 32], every nibble value
    packed = pack(codes, 4)
    assert packed.shape == (3, 16) and packed.dtype == torch.uint8
    assert int(packed[0, 0]) == 0 | (1 << 4)  # low nibble first
    assert torch.equal(unpack(packed, 4), codes)
    assert pack(codes, 8) is codes and unpack(codes, 8) is codes
    assert quantize(_keys(dim=16), 4, dim=1)[0].shape[-1] == 8


@pytest.mark.parametrize("call, message", [
    (lambda: levels(3), "4 or 8 bits, got 3"),
    (lambda: packed_width(5, 4), "must be even, got 5"),
    (lambda: quantize(torch.zeros(2, 3), 4, dim=0), "must be even, got 3"),
])
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()
