"""Packing a model for a backend (``build.pack_model``, ``packing.py``): what is refused and why, packing
twice, torch packing nothing, int8 weight-only copies, and the weight formats a packed model reports."""

from __future__ import annotations

import pytest
import torch

from specdecode.kv.cache import CacheConfig
from specdecode.models import packing
from specdecode.models.backends import INT8, TORCH
from specdecode.models.build import from_hf_tensors, pack_model
from specdecode.models.linear import Int8Linear, QuantLinear
from kernel_paths import NATIVE_PATHS, path_params
from tiny_models import random_hf_tensors, tiny_config, tiny_model, varied_model

OURS = path_params(NATIVE_PATHS)


@pytest.mark.parametrize("path", OURS)
def test_pack_model_names_what_is_wrong(path):
    model = varied_model(0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'fast' is not one of auto, tiled, avx512, avx2, onednn, torch"):
        pack_model(model, "fast")
    with pytest.raises(ValueError, match="weight format 'q5_k' is not one of"):
        pack_model(model, path, weights="q5_k")
    # torch runs everywhere and computes no block format (onednn, the other such backend, cannot run on every CPU)
    with pytest.raises(ValueError, match="q4_1 weights need one of our kernels .* run on torch"):
        pack_model(model, "torch", weights="q4_1")
    assert pack_model(model, "torch") is TORCH and model.backend is TORCH  # nothing swapped: still packable
    assert model.head_layer is None
    assert pack_model(model, path).name == path and model.backend.name == path
    with pytest.raises(ValueError, match=f"already run on {path}; cannot switch to onednn"):
        pack_model(model, "onednn")
    with pytest.raises(ValueError, match=f"already packed with bf16 weights on {path}; cannot repack them as q8_0"):
        pack_model(model, path, weights="q8_0")
    with pytest.raises(ValueError, match=f"the {path} kernel needs a bf16 model on the CPU .*float32"):
        pack_model(tiny_model("llama"), path)


@pytest.mark.parametrize("path", OURS)
def test_block_formats_are_chosen_per_projection_and_reported(path):
    model = varied_model(0, dtype=torch.bfloat16)
    assert pack_model(model, path, weights="q4_1") is pack_model(model, path, weights="q4_1")  # packing again: no-op
    assert isinstance(model.layers[0].wqkv, QuantLinear) and model.layers[0].wqkv.weight_format == "q4_1"
    assert model.weight_format == "q4_1, head q8_0"  # the output head at least q8_0
    assert packing.block_weights(model) and not packing.block_weights(varied_model(0, dtype=torch.bfloat16))


def test_pack_model_is_a_no_op_in_float32():
    model = tiny_model("llama")
    assert model.weight_nbytes > 0 and pack_model(model) is TORCH and model.head_layer is None
    assert model.weight_format == "float32"


def test_int8_model_halves_projection_bytes_and_stays_close():
    config = tiny_config("llama", tie_word_embeddings=True, hidden_size=64, intermediate_size=128)
    tensors = random_hf_tensors(config, seed=2, scale=0.2)
    plain = from_hf_tensors(config, tensors, dtype=torch.bfloat16)
    quant = from_hf_tensors(config, tensors, dtype=torch.bfloat16)
    packing.pack(quant, INT8)
    assert isinstance(quant.layers[0].w_down, Int8Linear) and quant.weight_format == "int8"
    assert quant.weight_nbytes < plain.weight_nbytes * 0.75
    assert pack_model(quant) is quant.backend is INT8 and quant.backend.name == "int8"
    with pytest.raises(ValueError, match="already packed or quantized"):
        packing.pack(quant, INT8)
    ids = torch.randint(0, config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = plain(ids, plain.new_cache(CacheConfig(max_len=16))).logits
        got = quant(ids, quant.new_cache(CacheConfig(max_len=16))).logits
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8
