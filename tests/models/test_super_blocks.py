"""K-quants kept as stored (q4_k, q6_k): read from GGUF blocks bitwise as the gguf package dequantizes them,
packed for the kernels and read back, stacked and sliced, and refused where a tensor is not stored so."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize
from tiny_gguf import k_quant_blocks

from specdecode.models.super_blocks import SUPER_FORMATS, SUPER_QTYPES, SuperBlockWeight, from_gguf
from specdecode.models.weights import choose_formats, concat, convert, unpack


def _stored(fmt: str, n: int = 5, k: int = 512, seed: int = 0) -> tuple[np.ndarray, SuperBlockWeight]:
    raw = k_quant_blocks(SUPER_QTYPES[fmt], (n, k), seed)
    return raw, from_gguf(raw, SUPER_QTYPES[fmt], (n, k))


@pytest.mark.parametrize("fmt", SUPER_FORMATS)
def test_stored_blocks_dequantize_bitwise_as_the_gguf_package(fmt):
    raw, w = _stored(fmt, 7, 768)
    assert w.fmt == fmt and w.shape == (7, 768) and w.codes.dtype == torch.uint8
    assert int(w.codes.max()) == {"q4_k": 15, "q5_k": 31, "q6_k": 63}[fmt]
    reference = torch.from_numpy(gguf_dequantize(raw, SUPER_QTYPES[fmt]).reshape(7, 768))
    assert torch.equal(w.dequantize(), reference)
    if fmt == "q6_k":  # every int8 scale, -128 included, is read as stored
        assert w.scales.dtype == torch.int8 and int(w.scales.min()) < -100 and int(w.scales.max()) > 100


@pytest.mark.parametrize("fmt", SUPER_FORMATS)
@pytest.mark.parametrize("tile,n", [(16, 16), (16, 37), (32, 5), (32, 70)])
def test_pack_and_unpack_round_trip_with_padded_outputs(fmt, tile, n):
    _, w = _stored(fmt, n, 512, seed=n)
    packed = w.pack(tile, chunk=3 * tile * 512)  # several chunks
    assert packed.shape == (-(-n // tile), 2, {"q4_k": 148, "q5_k": 180, "q6_k": 210}[fmt] * tile)
    back = unpack(packed, fmt, n, 512, tile)
    for name in ("codes", "scales", "mins", "d", "dmin"):
        a, b = getattr(back, name), getattr(w, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    pad = packed.view(-1)[packed.numel() - 1]  # the last tile's padded outputs are zero
    assert n % tile == 0 or int(pad) == 0


@pytest.mark.parametrize("fmt", SUPER_FORMATS)
def test_rows_and_concat_keep_every_field(fmt):
    _, a = _stored(fmt, 4, 256, seed=1)
    _, b = _stored(fmt, 3, 256, seed=2)
    both = concat([a, b])
    assert both.shape == (7, 256) and torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    order = torch.tensor([6, 0, 3])
    assert torch.equal(both.rows(order).dequantize(), both.dequantize()[order])
    with pytest.raises(ValueError, match="one format and input width"):
        concat([a, _stored(fmt, 2, 512)[1]])


def test_a_k_quant_comes_only_from_its_own_tensors():
    raw = k_quant_blocks(QT.Q4_K, (4, 256))
    assert convert(raw, QT.Q4_K, (4, 256), "q4_k", chunk=256).shape == (4, 256)  # one row per chunk
    with pytest.raises(ValueError, match="q6_k weights come only from Q6_K tensors, not Q4_K"):
        convert(raw, QT.Q4_K, (4, 256), "q6_k")
    with pytest.raises(ValueError, match="Q8_0 is not a K-quant"):
        from_gguf(np.zeros(34 * 8, dtype=np.uint8), QT.Q8_0, (1, 256))
    q41 = convert(raw, QT.Q4_K, (4, 256), "q4_1")  # asked for q4_1 (a draft's cheapest): its codes kept
    assert q41.fmt == "q4_1" and torch.equal(q41.codes, from_gguf(raw, QT.Q4_K, (4, 256)).codes)


def test_auto_keeps_every_parts_k_quant_as_stored():
    assert choose_formats("auto", ["q4_k", "q4_k", "q4_k"]) == ["q4_k"] * 3
    assert choose_formats("auto", ["q6_k"], head=True) == ["q6_k"]
    assert choose_formats("auto", ["q4_k", "q4_k", "q6_k"]) == ["q4_k", "q4_k", "q6_k"]  # a Q4_K_M file's q, k, v
    assert choose_formats("auto", ["q4_k", "q4_1"]) == ["q4_k", "q4_1"]
    assert choose_formats("auto", ["q5_k", "q5_k"]) == ["q5_k"] * 2
    assert choose_formats("q4_1", ["q6_k"]) == ["q4_1"]
    # "blocks": every K-quant in the 32-weight format that holds it, shared or not
    assert choose_formats("blocks", ["q4_k", "q4_k"]) == ["q4_1"] * 2
    assert choose_formats("blocks", ["q6_k"], head=True) == ["q8_0"]
    assert choose_formats("blocks", ["q4_k", "q4_k", "q6_k"]) == ["q4_1", "q4_1", "q8_0"]
