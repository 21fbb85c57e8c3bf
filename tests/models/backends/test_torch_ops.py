"""The backends on torch's own kernels (``backends/torch_ops.py``): oneDNN's packed copies giving F.linear's
numbers bitwise, torch packing nothing, int8 copies, and block formats refused with the reason."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specdecode.kv.cache import CacheConfig
from specdecode.models.backends import INT8, TORCH, OneDnnBackend
from specdecode.models.backends.base import EagerLayers
from specdecode.models.build import from_hf_tensors, pack_model
from specdecode.models.linear import Int8Linear, PackedLinear, can_pack
from specdecode.models.weights import quantize
from tiny_models import random_hf_tensors, tiny_config, varied_model


@pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)), reason="needs oneDNN bf16 on CPU")
@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False)])
def test_onednn_gives_f_linears_logits_bitwise(arch, tied):
    config = tiny_config(arch, tie_word_embeddings=tied)
    tensors = random_hf_tensors(config, seed=3, scale=0.2)
    plain = from_hf_tensors(config, tensors, dtype=torch.bfloat16)
    packed = from_hf_tensors(config, tensors, dtype=torch.bfloat16)
    before = packed.weight_nbytes
    backend = pack_model(packed, "onednn")
    assert isinstance(backend, OneDnnBackend) and pack_model(packed, "onednn") is backend  # idempotent
    assert isinstance(packed.layers[0].wqkv, PackedLinear) and isinstance(packed.runner, EagerLayers)
    assert all(block.attention_ops is None for block in packed.layers)  # rowwise_attention
    head = config.vocab_size * config.hidden_size * 2
    assert packed.weight_nbytes == before + (head if tied else 0)  # a tied head gains a packed copy
    ids = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = plain(ids, plain.new_cache(CacheConfig(max_len=16))).logits
        got = packed(ids, packed.new_cache(CacheConfig(max_len=16))).logits
    assert torch.equal(got, want)


def test_torch_packs_nothing_and_waits_for_no_cpu():
    model = varied_model(0, dtype=torch.bfloat16)
    layer = model.layers[0].wqkv
    assert pack_model(model, "torch") is TORCH and model.layers[0].wqkv is layer and model.head_layer is None
    TORCH.synchronize(torch.device("cpu"))  # nothing queued on a CPU
    copy = TORCH.linear(layer.weight, layer.bias)
    assert isinstance(copy, nn.Linear) and copy.weight.data_ptr() == layer.weight.data_ptr()  # no copy made


@pytest.mark.parametrize("backend", [TORCH, INT8, OneDnnBackend()], ids=lambda b: b.name)
def test_block_formats_are_refused_naming_the_backend(backend):
    assert not backend.block_formats and not backend.row_invariant
    with pytest.raises(ValueError, match=f"q4_1 weights need one of our kernels .* run on {backend.name}$"):
        backend.block_linear(quantize(torch.randn(32, 64), "q4_1"), None)


def test_int8_projections_are_int8_weight_only_copies():
    weight = torch.randn(16, 32)
    layer = INT8.linear(weight, None)
    assert isinstance(layer, Int8Linear) and layer.qweight.shape == (16, 32)
    assert (layer.dequantized() - weight).abs().max() <= weight.abs().max() / 127
