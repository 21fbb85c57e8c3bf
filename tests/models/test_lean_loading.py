"""Loading a GGUF without a float copy of the model: ``Transformer.packed_from`` builds, one projection at a
time, the same model that reading every float first (``from_hf_tensors`` + ``pack_weights``) gives; K-quant
conversions in chunks give what one pass gives."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from tiny_gguf import k_quant_blocks, random_tensors, tiny_config, write_gguf

from specdecode.kv.cache import CacheConfig
from specdecode.models.backends import resolve_backend
from specdecode.models.loader import load_checkpoint
from specdecode.models.transformer import Transformer
from specdecode.models.weights import convert, pack, quantize

QT = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))


def k_quant_model(tmp_path, arch: str):
    """A GGUF whose matrices are stored in every type a load converts: Q4_K, Q6_K, Q8_0, Q4_1, F32."""
    config = tiny_config(arch, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64,
                         tie_word_embeddings=arch == "qwen2")
    tensors = random_tensors(config)
    qtypes = {}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        qtypes.update({f"{p}self_attn.q_proj.weight": QT.Q4_K, f"{p}self_attn.k_proj.weight": QT.Q4_K,
                       f"{p}self_attn.v_proj.weight": QT.Q6_K, f"{p}self_attn.o_proj.weight": QT.Q8_0,
                       f"{p}mlp.gate_proj.weight": QT.Q4_K, f"{p}mlp.up_proj.weight": QT.Q4_1,
                       f"{p}mlp.down_proj.weight": QT.Q6_K})
    qtypes["model.embed_tokens.weight"] = QT.Q6_K
    return load_checkpoint(str(write_gguf(tmp_path / f"{arch}.gguf", config, tensors, qtypes=qtypes)))


def logits(model: Transformer) -> torch.Tensor:
    cache = model.new_cache(CacheConfig(max_len=32))
    return model(torch.tensor([[1, 5, 9, 2, 7]]), cache).logits


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("weights", ["auto", "q8_0", "bf16"])
def test_packed_from_builds_the_model_that_all_floats_give(tmp_path, arch, weights):
    ckpt = k_quant_model(tmp_path, arch)
    backend = resolve_backend("auto", torch.bfloat16, torch.device("cpu"))
    if not backend.packs:
        pytest.skip(f"no packing backend on this CPU ({backend.name})")
    lean = Transformer.packed_from(ckpt.config, ckpt.weights, torch.bfloat16, backend, weights)
    full = Transformer.from_hf_tensors(ckpt.config, dict(ckpt.tensors), torch.bfloat16)
    full.pack_weights(backend.name, weights=weights, source=ckpt.weights)
    assert lean.weight_format == full.weight_format
    assert not any(t.is_meta for t in [*lean.parameters(), *lean.buffers()])
    lean_state, full_state = lean.state_dict(), full.state_dict()
    assert lean_state.keys() == full_state.keys()
    for name, tensor in full_state.items():
        assert torch.equal(lean_state[name], tensor), name
    assert torch.equal(logits(lean), logits(full))


def test_auto_keeps_q4_k_codes_and_requantizes_q6_k_like_the_reference(tmp_path):
    ckpt = k_quant_model(tmp_path, "llama")
    source = ckpt.weights
    assert source.format("model.layers.0.mlp.gate_proj.weight") == "q4_1"  # Q4_K: its codes kept
    assert source.format("model.layers.0.mlp.down_proj.weight") == "q8_0"  # Q6_K: requantized
    down = ckpt.tensors["model.layers.0.mlp.down_proj.weight"]  # float32, as the gguf package dequantizes it
    assert torch.equal(source.blocks("model.layers.0.mlp.down_proj.weight", "q8_0").dequantize(),
                       quantize(down, "q8_0").dequantize())


@pytest.mark.parametrize("qtype, fmt", [(QT.Q6_K, "q8_0"), (QT.Q4_K, "q4_1"), (QT.Q4_K, "q8_0"), (QT.Q6_K, "q4_0")])
def test_conversion_in_chunks_equals_one_pass(qtype, fmt):
    raw = k_quant_blocks(qtype, (40, 512), seed=3)
    whole = convert(raw, qtype, (40, 512), fmt, chunk=1 << 30)
    parts = convert(raw, qtype, (40, 512), fmt, chunk=512 * 7)  # 7 rows at a time: a ragged last chunk
    for a, b in [(whole.codes, parts.codes), (whole.d, parts.d), (whole.m, parts.m)]:
        assert (a is None and b is None) or torch.equal(a, b)
    for tile in (16, 32):
        assert torch.equal(pack(whole, tile, chunk=1 << 30), pack(whole, tile, chunk=tile * 512 * 2))


def test_a_q8_0_tensor_with_code_minus_128_is_requantized_whole():
    w = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, QT.Q8_0).reshape(8, -1).copy()
    raw[5, 2 + 3] = 0x80  # int8 -128 in row 5's first block
    got = convert(raw, QT.Q8_0, (8, 64), "q8_0", chunk=64 * 2)
    assert (got.codes != 0).all()  # requantized: no code -128 (stored as 0) left
    want = quantize(torch.from_numpy(gguf.quants.dequantize(raw, QT.Q8_0)), "q8_0")
    assert torch.equal(got.codes, want.codes) and torch.equal(got.d, want.d)
