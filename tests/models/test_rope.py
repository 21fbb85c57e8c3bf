"""RoPE: the scaled inverse frequencies, the roll form of the rotation, and the tables a model keeps (``Rope``)."""

from __future__ import annotations

import pytest
import torch

from specdecode.models.rope import FIRST_TABLE, Rope, apply_rope, rope_inv_freq, rope_rows, rope_tables
from tiny_models import tiny_config

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def test_llama3_inv_freq_bands():
    config = tiny_config(rope_theta=500.0, rope_scaling=dict(LLAMA3))
    plain = rope_inv_freq(tiny_config(rope_theta=500.0))
    scaled = rope_inv_freq(config)
    wavelen = 2 * torch.pi / plain
    high = wavelen < 32 / 4.0  # short wavelengths: unchanged
    low = wavelen > 32 / 1.0  # long wavelengths: divided by factor
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    torch.testing.assert_close(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8.0)
    assert ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8.0)).all()


def test_unsupported_rope_scaling_is_refused():
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        rope_inv_freq(tiny_config(rope_scaling={"rope_type": "yarn", "factor": 2.0}))


def test_rope_roll_equals_rotate_half_bitwise():
    """The roll with a pre-negated sine half is the rotate-half formula, to the bit."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 5, 3, 8, generator=g).to(torch.bfloat16)  # [B, T, H, D]
    angles = torch.randn(5, 4, generator=g)
    cos = torch.cat((angles, angles), -1).cos().to(torch.bfloat16)[None, :, None]  # [1, T, 1, D]
    sin = torch.cat((angles, angles), -1).sin().to(torch.bfloat16)[None, :, None]
    rotated = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    signed_sin = torch.cat((-sin[..., :4], sin[..., 4:]), dim=-1)
    assert torch.equal(apply_rope(x, cos, signed_sin), x * cos + rotated * sin)


def test_tables_grow_by_doubling_and_follow_the_dtype():
    rope = Rope(tiny_config(rope_theta=500.0))
    assert rope.kind == (0, 0, 0, 0) and rope.inv_freq.shape == (1, 8)  # one kind of layer
    tables = rope.tables(10, torch.float32)
    cos = tables[0][0]
    assert cos.shape[0] == FIRST_TABLE and rope.tables(FIRST_TABLE, torch.float32) is tables  # kept while it fits
    grown = rope.tables(FIRST_TABLE + 1, torch.float32)[0][0]
    assert grown.shape[0] == 2 * FIRST_TABLE and torch.equal(grown[:FIRST_TABLE], cos)  # positions keep their angles
    assert torch.equal(rope.tables(700, torch.float32)[0][0, :2 * FIRST_TABLE], grown)
    want_cos, want_sin = rope_tables(rope.inv_freq[0], 700, torch.bfloat16)
    got_cos, got_sin = rope.tables(700, torch.bfloat16)  # another dtype: rebuilt
    assert got_cos.dtype == torch.bfloat16 and torch.equal(got_cos[0, :700], want_cos)
    assert torch.equal(got_sin[0, :700], want_sin)
    assert rope.rows(10)[0].shape == (1, FIRST_TABLE, 8)
    rows_cos, rows_sin = rope.rows(300)
    want_cos, want_sin = rope_rows(rope.inv_freq[0], 300)
    assert rows_cos.shape == (1, 2 * FIRST_TABLE, 8) and rows_cos.dtype == torch.float32
    assert torch.equal(rows_cos[0, :300], want_cos) and torch.equal(rows_sin[0, :300], want_sin)


def test_both_table_forms_hold_the_same_angles():
    """The fused layers' fp32 half tables and the torch layers' tables rotate by the same angles (to fp32 rounding)."""
    rope = Rope(tiny_config(rope_theta=500.0))
    cos, sin = (t[0] for t in rope.tables(64, torch.float32))
    half_cos, half_sin = (t[0] for t in rope.rows(64))
    torch.testing.assert_close(cos[:64, :8], half_cos[:64], atol=1e-5, rtol=0)
    torch.testing.assert_close(cos[:64, 8:], half_cos[:64], atol=1e-5, rtol=0)
    torch.testing.assert_close(sin[:64, 8:], half_sin[:64], atol=1e-5, rtol=0)
    torch.testing.assert_close(sin[:64, :8], -half_sin[:64], atol=1e-5, rtol=0)  # the first half negated


def test_gemma3_windowed_layers_have_their_own_unscaled_base():
    """Gemma 3: the full-attention layers use rope_theta (and its scaling), the windowed ones local_rope_theta
    unscaled, each layer reading its kind's table."""
    config = tiny_config("gemma3", rope_scaling={"rope_type": "linear", "factor": 8.0})
    rope = Rope(config)
    assert rope.kind == (1, 1, 0, 1)  # layer 2 attends to everything: kind 0, the model's own base
    d = config.head_dim
    base = torch.arange(0, d, 2, dtype=torch.float64) / d
    torch.testing.assert_close(rope.inv_freq[0], (1 / (1e6 ** base) / 8).float())
    torch.testing.assert_close(rope.inv_freq[1], (1 / (1e4 ** base)).float())
    cos, _ = rope.tables(16, torch.float32)
    assert cos.shape[0] == 2 and not torch.equal(cos[0], cos[1])
    all_local = Rope(tiny_config("gemma3", window_layers=(True,) * 4))  # one kind, the local one
    assert all_local.kind == (0, 0, 0, 0) and torch.equal(all_local.inv_freq[0], rope.inv_freq[1])
    # kinds go by whether a layer is local, not by its base's value: the same base, unscaled on local layers
    same_base = Rope(tiny_config("gemma3", local_rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert same_base.kind == (1, 1, 0, 1) and torch.equal(same_base.inv_freq[0] * 8, same_base.inv_freq[1])
