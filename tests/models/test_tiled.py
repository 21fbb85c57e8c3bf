"""When the tiled kernel cannot be had: the reasons given, and the fallback of ``pack_weights``."""

from __future__ import annotations

import pytest
import torch

from specdecode.models import tiled
from specdecode.models.linear import can_pack
from tiny_models import varied_model


def test_reasons_name_what_is_missing(monkeypatch):
    monkeypatch.setattr(tiled.platform, "machine", lambda: "aarch64")
    assert tiled._static_reason() == "needs an x86-64 CPU (this is aarch64)"
    monkeypatch.setattr(tiled.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(tiled, "cpu_flags", lambda: frozenset({"avx512f", "avx512bw", "avx512vl"}))
    assert tiled._static_reason() == "the CPU lacks avx512_bf16"
    monkeypatch.setattr(tiled, "cpu_flags", lambda: frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}))
    monkeypatch.setattr(tiled.shutil, "which", lambda name: None)
    assert tiled._static_reason() == "ninja is not on PATH (needed to compile the kernel)"


def test_pack_layout_pads_and_interleaves_pairs():
    weight = torch.arange(70 * 5, dtype=torch.float32).view(70, 5).to(torch.bfloat16)  # N = 70, K = 5 (odd)
    packed = tiled.pack(weight)
    assert packed.shape == (2, 3, 64, 2)  # ceil(70/64) tiles, ceil(5/2) feature pairs
    assert torch.equal(packed[0, 1, 7], weight[7, 2:4])  # tile 0, pair 1, output 7 = features 2, 3
    assert torch.equal(packed[1, 2, 5], torch.stack([weight[69, 4], torch.tensor(0, dtype=torch.bfloat16)]))
    assert not packed[1, :, 6:].any()  # outputs 70.. are zero padding


@pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)), reason="needs oneDNN bf16 on CPU")
def test_auto_falls_back_to_onednn_and_an_explicit_request_says_why(monkeypatch):
    monkeypatch.setattr(tiled, "_built", (None, "the CPU lacks avx512_bf16"))
    model = varied_model(0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the tiled kernel is unavailable: the CPU lacks avx512_bf16"):
        model.pack_weights("tiled")
    assert model.linear_kernel == "torch"  # nothing half-swapped
    assert model.pack_weights("auto") == "onednn"
