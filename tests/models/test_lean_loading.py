"""Loading a GGUF without a float copy of the model: ``build.packed_from`` builds, one projection at a
time, the same model that reading every float first (``from_hf_tensors`` + ``packing.pack``) gives; K-quant
conversions in chunks give what one pass gives."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from kernel_paths import NATIVE_PATHS, path_params
from tiny_gguf import VOCAB_SIZE, k_quant_blocks, random_tensors, tiny_config, write_gguf

from specdecode.drafters import NgramDrafter
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.kv.cache import CacheConfig
from specdecode.models import packing
from specdecode.models.backends import resolve_backend
from specdecode.models.build import from_hf_tensors, packed_from
from specdecode.models.loader import load_checkpoint
from specdecode.models.transformer import Transformer
from specdecode.models.weights import convert, quantize

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
@pytest.mark.parametrize("weights", ["auto", "blocks", "q8_0", "bf16"])
def test_packed_from_builds_the_model_that_all_floats_give(tmp_path, arch, weights):
    ckpt = k_quant_model(tmp_path, arch)
    backend = resolve_backend("auto", torch.bfloat16, torch.device("cpu"))
    if not backend.packs:
        pytest.skip(f"no packing backend on this CPU ({backend.name})")
    lean = packed_from(ckpt.config, ckpt.weights, torch.bfloat16, backend, weights)
    full = from_hf_tensors(ckpt.config, dict(ckpt.tensors), torch.bfloat16)
    packing.pack(full, backend, weights, ckpt.weights)
    assert lean.weight_format == full.weight_format
    assert not any(t.is_meta for t in [*lean.parameters(), *lean.buffers()])
    lean_state, full_state = lean.state_dict(), full.state_dict()
    assert lean_state.keys() == full_state.keys()
    for name, tensor in full_state.items():
        assert torch.equal(lean_state[name], tensor), name
    assert torch.equal(logits(lean), logits(full))


def test_k_quants_are_read_as_stored_and_blocks_maps_them_like_the_reference(tmp_path):
    ckpt = k_quant_model(tmp_path, "llama")
    source = ckpt.weights
    gate, down = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight"
    assert source.format(gate) == "q4_k" and source.format(down) == "q6_k"
    for name in (gate, down):  # as stored: bitwise the values the gguf package dequantizes
        assert torch.equal(source.blocks(name, source.format(name)).dequantize(), ckpt.tensors[name])
    # "blocks": Q4_K's codes as q4_1, Q6_K requantized to q8_0 as the reference quantizer does
    assert torch.equal(source.blocks(gate, "q4_1").codes, source.blocks(gate, "q4_k").codes)
    assert torch.equal(source.blocks(down, "q8_0").dequantize(), quantize(ckpt.tensors[down], "q8_0").dequantize())


@pytest.mark.parametrize("path", path_params(NATIVE_PATHS))
def test_parts_in_formats_of_their_own_keep_their_values_and_give_the_same_bits_on_one_and_two_threads(tmp_path, path):
    """q/k/v as a Q4_K_M file stores them (Q4_K q and k, Q6_K v): the split projection's biases are the
    checkpoint's, part by part, and a fused forward whose tiles are shared between threads by bytes gives the
    bits of one thread on two (the q/k/v boundary falls inside the Q4_K part: 12 tiles of 148-byte records
    before 4 of 210 at 32 outputs a tile)."""
    ckpt = k_quant_model(tmp_path, "qwen2")
    target = packed_from(ckpt.config, ckpt.weights, torch.bfloat16,
                         resolve_backend(path, torch.bfloat16, torch.device("cpu")), "auto")
    wqkv = target.layers[1].wqkv
    want = torch.cat([ckpt.weights.tensors[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv"])
    assert torch.equal(torch.cat([part.bias for part in wqkv.parts]), want.float())
    tokens = torch.randint(0, VOCAB_SIZE, (13,), generator=torch.Generator().manual_seed(2))
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                outs.append(target.forward_rows(tokens, target.new_cache(CacheConfig(max_len=16)), (0,), (13,)).logits)
    finally:
        torch.set_num_threads(1)
    assert all(torch.equal(outs[0], out) for out in outs[1:])


def k_quant_only_model(tmp_path, arch: str):
    """A GGUF whose every projection is one K-quant (attention and gate/up Q4_K, o Q5_K, down and head Q6_K)."""
    config = tiny_config(arch, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64,
                         tie_word_embeddings=False, vocab_size=VOCAB_SIZE)
    qtypes = {"lm_head.weight": QT.Q6_K}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        qtypes.update({f"{p}self_attn.{n}_proj.weight": QT.Q4_K for n in "qkv"})
        qtypes.update({f"{p}self_attn.o_proj.weight": QT.Q5_K, f"{p}mlp.gate_proj.weight": QT.Q4_K,
                       f"{p}mlp.up_proj.weight": QT.Q4_K, f"{p}mlp.down_proj.weight": QT.Q6_K})
    return load_checkpoint(str(write_gguf(tmp_path / f"{arch}.gguf", config, random_tensors(config), qtypes=qtypes)))


@pytest.mark.parametrize("path", path_params(NATIVE_PATHS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])  # gemma3: windows of 8 that 36 tokens pass
@pytest.mark.parametrize("mixed", [False, True], ids=["one-format-each", "parts-in-formats-of-their-own"])
def test_k_quants_as_stored_speculate_exactly_and_rows_are_invariant(tmp_path, path, arch, mixed):
    ckpt = (k_quant_model if mixed else k_quant_only_model)(tmp_path, arch)
    target = packed_from(ckpt.config, ckpt.weights, torch.bfloat16,
                         resolve_backend(path, torch.bfloat16, torch.device("cpu")), "auto")
    if mixed:  # every part as stored: Q4_K q and k beside Q6_K v, Q4_K gate beside Q4_1 up
        assert target.layers[0].wqkv.formats == ["q4_k", "q6_k"] and target.layers[0].w_gate_up.formats == ["q4_k", "q4_1"]
    else:
        assert target.weight_format == "q4_k+q5_k+q6_k, head q6_k"
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9], [90, 3, 17, 44, 2, 60], [90, 3, 90, 4, 90, 5, 90, 6]]
    plain = [Engine(target).generate(p, max_new_tokens=24).token_ids for p in prompts]
    drafted = accepted = 0
    for gamma in (2, 7):  # verifications of 3 and 8 rows: q6_k's one-row and unpacked paths both
        engine = Engine(target, drafter=NgramDrafter(max_ngram=3, min_ngram=1), spec=SpeculativeConfig(gamma=gamma))
        for prompt, want in zip(prompts, plain):
            result = engine.generate(prompt, max_new_tokens=24)
            assert result.token_ids == want, (gamma, prompt)
            drafted, accepted = drafted + result.stats.drafted_tokens, accepted + result.stats.accepted_tokens
    assert drafted > accepted  # rejections were rolled back
    with torch.inference_mode():  # each row of a batch bitwise what it is alone
        tokens = torch.tensor([[1, 5, 9, 2, 7, 3]])
        whole = target(tokens, target.new_cache(CacheConfig(max_len=16))).logits[0]
        cache = target.new_cache(CacheConfig(max_len=16))
        target(tokens[:, :3], cache)
        assert torch.equal(target(tokens[:, 3:], cache).logits[0], whole[3:])
        cache = target.new_cache(CacheConfig(max_len=16))  # one row at a time: q6_k's one-row path
        steps = [target(tokens[:, i:i + 1], cache).logits[0, 0] for i in range(6)]
        assert torch.equal(torch.stack(steps), whole)


@pytest.mark.parametrize("path", path_params(NATIVE_PATHS))
def test_q5_0_and_q5_1_as_stored_speculate_exactly(tmp_path, path):
    """A GGUF with Q5_0 attention and gate/up, Q5_1 o and down (Gemma 3's files are mostly Q5_0): read as
    stored, and greedy speculation over them is plain decoding."""
    config = tiny_config("gemma3", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64)
    qtypes = {}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        qtypes.update({f"{p}self_attn.{n}_proj.weight": QT.Q5_0 for n in "qkv"})
        qtypes.update({f"{p}self_attn.o_proj.weight": QT.Q5_1, f"{p}mlp.gate_proj.weight": QT.Q5_0,
                       f"{p}mlp.up_proj.weight": QT.Q5_0, f"{p}mlp.down_proj.weight": QT.Q5_1})
    tensors = {n: t * 0.05 if "norm" not in n else t for n, t in random_tensors(config).items()}
    ckpt = load_checkpoint(str(write_gguf(tmp_path / "q5.gguf", config, tensors, qtypes=qtypes)))
    target = packed_from(ckpt.config, ckpt.weights, torch.bfloat16,
                         resolve_backend(path, torch.bfloat16, torch.device("cpu")), "auto")
    assert target.weight_format.startswith("q5_0+q5_1")
    assert target.layers[0].post_mlp_norm.dtype == target.norm.dtype == torch.float32  # read one tensor at a time too
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9], [90, 3, 17, 44, 2, 60]]
    engine = Engine(target, drafter=NgramDrafter(max_ngram=3, min_ngram=1), spec=SpeculativeConfig(gamma=5))
    for prompt in prompts:
        want = Engine(target).generate(prompt, max_new_tokens=24).token_ids
        result = engine.generate(prompt, max_new_tokens=24)
        assert result.token_ids == want and result.stats.drafted_tokens > 0


@pytest.mark.parametrize("qtype, fmt", [(QT.Q6_K, "q8_0"), (QT.Q4_K, "q4_1"), (QT.Q4_K, "q8_0"), (QT.Q6_K, "q4_0")])
def test_conversion_in_chunks_equals_one_pass(qtype, fmt):
    raw = k_quant_blocks(qtype, (40, 512), seed=3)
    whole = convert(raw, qtype, (40, 512), fmt, chunk=1 << 30)
    parts = convert(raw, qtype, (40, 512), fmt, chunk=512 * 7)  # 7 rows at a time: a ragged last chunk
    for a, b in [(whole.codes, parts.codes), (whole.d, parts.d), (whole.m, parts.m)]:
        assert (a is None and b is None) or torch.equal(a, b)
    for tile in (16, 32):
        assert torch.equal(whole.pack(tile, chunk=1 << 30), whole.pack(tile, chunk=tile * 512 * 2))


def test_a_q8_0_tensor_with_code_minus_128_is_requantized_whole():
    w = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, QT.Q8_0).reshape(8, -1).copy()
    raw[5, 2 + 3] = 0x80  # int8 -128 in row 5's first block
    got = convert(raw, QT.Q8_0, (8, 64), "q8_0", chunk=64 * 2)
    assert (got.codes != 0).all()  # requantized: no code -128 (stored as 0) left
    want = quantize(torch.from_numpy(gguf.quants.dequantize(raw, QT.Q8_0)), "q8_0")
    assert torch.equal(got.codes, want.codes) and torch.equal(got.d, want.d)
