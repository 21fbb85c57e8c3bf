"""Pre-packed oneDNN linears (bitwise F.linear in bf16 at every row count we run) and int8 weight-only ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdecode.kv.cache import CacheConfig
from specdecode.models.linear import Int8Linear, PackedLinear, can_pack
from specdecode.models.transformer import Transformer
from tiny_models import random_hf_tensors, tiny_config

needs_onednn = pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)), reason="needs oneDNN bf16 on CPU")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_f_linear_bitwise(rows, bias):
    g = torch.Generator().manual_seed(rows)
    layer = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(1, rows, 96, generator=g).to(torch.bfloat16)  # [B, T, in]
    packed = PackedLinear(layer.weight, layer.bias)
    with torch.inference_mode():
        got = packed(x)
        assert got.shape == (1, rows, 160)
        assert torch.equal(got, F.linear(x, layer.weight, layer.bias))


@needs_onednn
def test_packing_refuses_float32_and_reports_bytes():
    with pytest.raises(ValueError, match="cannot pack a torch.float32 weight"):
        PackedLinear(torch.zeros(4, 4))
    packed = PackedLinear(torch.zeros(8, 4, dtype=torch.bfloat16))
    assert packed.nbytes == 8 * 4 * 2 and "packed" in repr(packed)


def test_int8_weights_within_half_a_step_and_output_close():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 48, generator=g)
    layer = Int8Linear(weight, torch.randn(64, generator=g), dtype=torch.float32)
    step = weight.abs().amax(dim=1, keepdim=True) / 127  # one quantization step per output row
    assert ((layer.dequantized() - weight).abs() <= step / 2 + 1e-7).all()
    assert layer.qweight.dtype == torch.int8 and layer.qweight.abs().max() == 127
    x = torch.randn(3, 48, generator=g)
    exact = x @ layer.dequantized().T + layer.bias
    torch.testing.assert_close(layer(x), exact, atol=1e-4, rtol=1e-4)  # the kernel computes with s * Q
    assert not torch.allclose(layer(x), x @ weight.T + layer.bias, atol=1e-5)  # ... which is not the float weight


def test_int8_model_halves_projection_bytes_and_stays_close():
    config = tiny_config("llama", tie_word_embeddings=True, hidden_size=64, intermediate_size=128)
    tensors = random_hf_tensors(config, seed=2, scale=0.2)
    plain = Transformer.from_hf_tensors(config, tensors, dtype=torch.bfloat16)
    quant = Transformer.from_hf_tensors(config, tensors, dtype=torch.bfloat16)
    quant.quantize_weights()
    assert quant.weight_nbytes < plain.weight_nbytes * 0.75
    assert not quant.pack_weights()
    with pytest.raises(ValueError, match="already packed or quantized"):
        quant.quantize_weights()
    ids = torch.randint(0, config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = plain(ids, plain.new_cache(CacheConfig(max_len=16)))
        got = quant(ids, quant.new_cache(CacheConfig(max_len=16)))
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8
