"""Block weight formats: llama.cpp's own blocks read without a round trip, quantization as llama.cpp's reference
quantizer does it, the Q4_K mapping, the kernels' packed layout, and the format each projection gets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

from specdecode.models.weights import (BLOCK_FORMATS, BlockWeight, choose_formats, concat, convert, from_gguf,
                                       quantize, unpack)

QTYPES = {"q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q5_0": QT.Q5_0, "q5_1": QT.Q5_1}
STORED = [*BLOCK_FORMATS, "q5_0", "q5_1"]  # the 32-weight formats read as stored


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.2  # rows of different scales


@pytest.mark.parametrize("fmt", STORED)
def test_a_gguf_files_blocks_are_read_as_stored(fmt):
    """Codes and scales of raw GGUF blocks, dequantized, equal the gguf package's own dequantization bitwise."""
    w = _weight(40, 96).numpy()
    raw = gguf_quantize(w, QTYPES[fmt])
    blocks = from_gguf(raw, QTYPES[fmt], (40, 96))
    assert blocks.fmt == fmt and blocks.codes.dtype == torch.uint8 and blocks.d.dtype == torch.float16
    assert torch.equal(blocks.dequantize(), torch.from_numpy(gguf_dequantize(raw, QTYPES[fmt])))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_quantize_is_llama_cpps_reference_quantizer_and_pads_the_last_block(fmt):
    w = _weight(7, 70)  # K = 70: two whole blocks and a padded one
    blocks = quantize(w, fmt)
    assert blocks.shape == (7, 70) and blocks.codes.shape == (7, 96)
    padded = torch.nn.functional.pad(w, (0, 26)).numpy()
    reference = gguf_dequantize(gguf_quantize(padded, QTYPES[fmt]), QTYPES[fmt])[:, :70]
    assert torch.equal(blocks.dequantize(), torch.from_numpy(reference))
    step = {"q8_0": 1 / 127, "q4_0": 1 / 7, "q4_1": 1 / 15}[fmt]  # half a code step of the block's range, at most
    assert ((blocks.dequantize() - w).abs() <= w.abs().amax(1, keepdim=True) * step + 1e-6).all()


def _q4_k_blocks(n_super: int, seed: int = 0) -> np.ndarray:
    """Random but well-formed Q4_K super-blocks (144 bytes each: fp16 d, dmin, 12 scale bytes, 128 nibble bytes)."""
    rng = np.random.default_rng(seed)
    d = (rng.random((n_super, 1)) * 1e-3).astype(np.float16).view(np.uint8)
    dmin = (rng.random((n_super, 1)) * 1e-3).astype(np.float16).view(np.uint8)
    rest = rng.integers(0, 256, (n_super, 140), dtype=np.uint8)
    return np.concatenate([d, dmin, rest], axis=1)


def test_q4_k_maps_to_q4_1_code_for_code_with_fp16_scales():
    raw = _q4_k_blocks(6)  # 3 rows of 512 weights
    blocks = from_gguf(raw, QT.Q4_K, (3, 512))
    assert blocks.fmt == "q4_1" and blocks.d.shape == (3, 16)
    reference = torch.from_numpy(gguf_dequantize(raw.reshape(3, -1), QT.Q4_K))
    got = blocks.dequantize()
    # The codes are kept; only the sub-blocks' scale d*sc and minimum dmin*m are rounded to fp16.
    scale, minimum = blocks.d.float().repeat_interleave(32, 1), blocks.m.float().abs().repeat_interleave(32, 1)
    assert ((got - reference).abs() <= (15 * scale + minimum) * 2**-11 + 1e-12).all()
    assert not torch.equal(got, reference)  # the rounding is real, so the bound above is what is tested


def test_a_q8_0_tensor_holding_code_minus_128_is_not_read_as_stored():
    """llama.cpp never writes -128 (AVX2's sign trick could not multiply it); such a tensor is requantized."""
    raw = gguf_quantize(_weight(4, 64).numpy(), QT.Q8_0).reshape(4, -1, 34).copy()
    assert from_gguf(raw, QT.Q8_0, (4, 64)) is not None
    raw[1, 0, 5] = 0x80  # code -128
    assert from_gguf(raw, QT.Q8_0, (4, 64)) is None


def test_formats_that_are_not_read_as_stored_return_none():
    assert from_gguf(np.zeros(4 * 32 * 2, dtype=np.uint8), QT.F16, (4, 32)) is None
    assert from_gguf(np.zeros(210, dtype=np.uint8), QT.Q6_K, (1, 256)) is None


@pytest.mark.parametrize("fmt", STORED)
@pytest.mark.parametrize("tile", [16, 32])
def test_pack_and_unpack_round_trip(fmt, tile):
    if fmt in BLOCK_FORMATS:
        blocks = quantize(_weight(45, 100), fmt)  # 45 outputs: the last tile is padding
    else:  # stored only: llama.cpp's blocks of a 128-wide weight, read as 100 inputs
        blocks = from_gguf(gguf_quantize(_weight(45, 128).numpy(), QTYPES[fmt]), QTYPES[fmt], (45, 128))
        blocks = BlockWeight(fmt, blocks.codes, blocks.d, blocks.m, 100)
    packed = blocks.pack(tile)
    code = {"q8_0": 32, "q5_0": 20, "q5_1": 20}.get(fmt, 16)  # q5: nibbles, then 4 bytes of fifth bits per output
    record = tile * code + 2 * tile * (2 if fmt in ("q4_1", "q5_1") else 1)
    assert packed.shape == (-(-45 // tile), 4, record) and packed.dtype == torch.uint8
    back = unpack(packed, fmt, 45, 100, tile)
    assert torch.equal(back.codes, blocks.codes) and torch.equal(back.d, blocks.d)
    assert (back.m is None) == (blocks.m is None) and (back.m is None or torch.equal(back.m, blocks.m))


def test_pack_lays_out_what_the_kernel_reads():
    """q4 records: vector (pair p, lane n) holds inputs 4p..4p+3 in its low nibbles and 16+4p.. in its high ones."""
    codes = torch.randint(0, 16, (16, 32), dtype=torch.uint8)
    blocks = BlockWeight("q4_0", codes, torch.ones(16, 1, dtype=torch.float16), None, 32)
    record = blocks.pack(16)[0, 0]
    lane, p, j = 5, 2, 3
    byte = record[(p * 16 + lane) * 4 + j]
    assert byte & 0x0F == codes[lane, 4 * p + j] and byte >> 4 == codes[lane, 16 + 4 * p + j]


def test_concat_stacks_outputs_of_one_format_only():
    a, b = quantize(_weight(3, 64), "q8_0"), quantize(_weight(2, 64, seed=1), "q8_0")
    both = concat([a, b])
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="one format and input width"):
        concat([a, quantize(_weight(2, 64), "q4_0")])


def test_q5_formats_come_only_from_their_own_tensors():
    raw = gguf_quantize(_weight(4, 64).numpy(), QT.Q4_0)
    with pytest.raises(ValueError, match="q5_0 weights come only from Q5_0 tensors, not Q4_0"):
        convert(raw, QT.Q4_0, (4, 64), "q5_0")
    q5 = gguf_quantize(_weight(4, 64).numpy(), QT.Q5_1)
    assert convert(q5, QT.Q5_1, (4, 64), "q5_1").fmt == "q5_1"
    assert convert(q5, QT.Q5_1, (4, 64), "q8_0").fmt == "q8_0"  # an explicit q8_0: requantized


def test_choose_formats():
    assert choose_formats("auto", ["q5_0"]) == ["q5_0"] and choose_formats("blocks", ["q5_1"]) == ["q5_1"]
    assert choose_formats("blocks", ["q4_k"]) == ["q4_1"] and choose_formats("blocks", ["q6_k", "q6_k"]) == ["q8_0"] * 2
    assert choose_formats("auto", ["q5_0", "q5_0", "q8_0"]) == ["q5_0", "q5_0", "q8_0"]  # Gemma's q, k, v as stored
    assert choose_formats("auto", ["q4_1"]) == ["q4_1"] and choose_formats("auto", ["bf16", "q4_1"]) == ["bf16"] * 2
    assert choose_formats("q4_0", ["bf16"]) == ["q4_0"] and choose_formats("q4_1", ["q8_0"], head=True) == ["q8_0"]
    assert choose_formats("q4_1+head", ["q8_0"], head=True) == ["q4_1"]  # a draft's head: q4_1 too
    assert choose_formats("q4_1+head", ["q4_k", "q6_k"]) == ["q4_1"] * 2
    assert choose_formats("q4_0+head", ["q8_0"], head=True) == ["q4_0"]  # q4_0's head: q4_0 too
    assert choose_formats("q4_0+head", ["q4_k", "q6_k"]) == ["q4_0"] * 2
    assert choose_formats("q8_0", ["q4_1"], head=True) == ["q8_0"] and choose_formats("bf16", ["q4_1"]) == ["bf16"]
    assert choose_formats("q4_1", ["q4_k", "q6_k"]) == ["q4_1", "q4_1"]  # an explicit format: every part


@pytest.mark.integration
def test_smollm2s_q4_1_and_q8_0_blocks_are_read_without_a_round_trip(smollm2_path):
    from specdecode.models.loader import load_checkpoint

    ckpt = load_checkpoint(str(smollm2_path))
    source = ckpt.weights
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.3.self_attn.q_proj.weight",
                 "model.embed_tokens.weight"):
        fmt = source.format(name)
        assert fmt == ("q8_0" if "embed" in name else "q4_1")
        blocks = source.blocks(name, fmt)
        # llama.cpp's Q/K row permutation is undone on the blocks as on the floats
        assert torch.equal(blocks.dequantize(), ckpt.tensors[name]), name
