"""load_checkpoint: GGUF (as llama.cpp writes it) and HF folders round trip; every bad source fails clearly."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file
from tiny_gguf import llama_cpp_permute, random_tensors, tiny_config, tokenizer_metadata, write_gguf

from specdecode.models import loader
from specdecode.models.build import from_hf_tensors
from specdecode.models.config import ModelConfig
from specdecode.models.loader import Checkpoint, GGUFError, LoadError, load_checkpoint, read_gguf, unpermute_rotary
from specdecode.models.registry import UnknownModelError
from specdecode.models.tokenizer import Tokenizer


@pytest.fixture(autouse=True)
def cache(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeps converted tokenizers of throwaway files out of the shared cache (integration tests use it)."""
    if request.node.get_closest_marker("integration") is None:
        monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32 and got[name].device.type == "cpu"
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),
    ("llama", {"num_kv_heads": 4, "tie_word_embeddings": False}),
    ("qwen2", {}),
    ("qwen2", {"tie_word_embeddings": True, "head_dim": 32}),
    ("qwen3", {"tie_word_embeddings": True}),
])
def test_gguf_round_trip(tmp_path: Path, arch: str, overrides: dict) -> None:
    config = tiny_config(arch, **overrides)
    tensors = random_tensors(config)
    ckpt = load_checkpoint(str(write_gguf(tmp_path / "m.gguf", config, tensors)))
    assert isinstance(ckpt, Checkpoint) and ckpt.source == str(tmp_path / "m.gguf")
    assert ckpt.config == config
    assert_same_tensors(ckpt.tensors, tensors)
    assert ckpt.tokenizer.decode(ckpt.tokenizer.encode("the 12 in")) == "the 12 in"


def test_gguf_quantized_tensors_dequantize_like_gguf(tmp_path: Path) -> None:
    config = tiny_config("llama")
    tensors = random_tensors(config)
    qtypes = {"model.layers.0.mlp.up_proj.weight": gguf.GGMLQuantizationType.Q8_0,
              "model.layers.1.self_attn.q_proj.weight": gguf.GGMLQuantizationType.Q4_1,
              "model.embed_tokens.weight": gguf.GGMLQuantizationType.F16}
    ckpt = load_checkpoint(str(write_gguf(tmp_path / "q.gguf", config, tensors, qtypes=qtypes)))
    for name, qtype in qtypes.items():
        stored = tensors[name].numpy()
        if ".q_proj." in name:
            stored = llama_cpp_permute(stored, config.num_heads)
        want = torch.from_numpy(dequantize(quantize(stored, qtype), qtype).reshape(stored.shape))
        if ".q_proj." in name:
            want = unpermute_rotary(want, config.num_heads)
        assert torch.equal(ckpt.tensors[name], want), name
        assert not torch.equal(ckpt.tensors[name], tensors[name])  # it really was quantized


@pytest.mark.parametrize("n_heads", [1, 2, 4])
def test_unpermute_inverts_llama_cpp(n_heads: int) -> None:
    w = torch.randn(n_heads * 8, 5)
    assert torch.equal(unpermute_rotary(torch.from_numpy(llama_cpp_permute(w.numpy(), n_heads)), n_heads), w)
    b = torch.randn(n_heads * 8)
    assert torch.equal(unpermute_rotary(torch.from_numpy(llama_cpp_permute(b.numpy(), n_heads)), n_heads), b)


def test_read_gguf_agrees_with_gguf_reader(tmp_path: Path) -> None:
    config = tiny_config("qwen2")
    path = write_gguf(tmp_path / "m.gguf", config, random_tensors(config),
                      qtypes={"model.layers.0.mlp.down_proj.weight": gguf.GGMLQuantizationType.Q8_0})
    ours, ref = read_gguf(path), gguf.GGUFReader(path)
    assert list(ours.metadata) == [k for k in ref.fields if not k.startswith("GGUF.")]
    for key, value in ours.metadata.items():
        want = ref.fields[key].contents()
        assert value == (pytest.approx(want) if isinstance(want, float) else want), key
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert (info.offset, info.nbytes, info.qtype) == (t.data_offset, t.n_bytes, t.tensor_type)
        assert info.shape == tuple(int(d) for d in reversed(t.shape))


def test_gguf_config_reads_rope_scaling(tmp_path: Path) -> None:
    config = tiny_config("llama")
    path = write_gguf(tmp_path / "m.gguf", config, random_tensors(config))
    parsed = read_gguf(path)
    meta = {**parsed.metadata, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    got = loader.gguf_config(dataclasses.replace(parsed, metadata=meta))
    assert got.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    config = tiny_config("llama")
    path = write_gguf(tmp_path / "g.gguf", config, random_tensors(config), arch="gemma")
    with pytest.raises(LoadError, match=r"g\.gguf.*'gemma'"):
        load_checkpoint(str(path))


def test_gguf_missing_tensor(tmp_path: Path) -> None:
    config = tiny_config("llama")
    tensors = random_tensors(config)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(LoadError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(str(write_gguf(tmp_path / "m.gguf", config, tensors)))


# ------------------------------------------------------------------------------------------------
# Corrupt files and bad sources

def test_truncated_gguf(tmp_path: Path) -> None:
    config = tiny_config("llama")
    data = write_gguf(tmp_path / "m.gguf", config, random_tensors(config)).read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 2000, 10):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match=rf"cut{cut}\.gguf.*(truncated|past the end)"):
            load_checkpoint(str(bad))


@pytest.mark.parametrize("content, match", [
    (b"", "not a valid GGUF"),
    (b"PK\x03\x04 definitely a zip file", "not a GGUF file"),
    (b"GGUF\x00\x00\x00\x03" + bytes(64), "big-endian"),
    (b"GGUF\x03\x00\x00\x00" + (1).to_bytes(8, "little") + (1).to_bytes(8, "little") + (2**62).to_bytes(8, "little"),
     "past the end"),
])
def test_garbage_gguf(tmp_path: Path, content: bytes, match: str) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(GGUFError, match=match) as err:
        load_checkpoint(str(bad))
    assert str(bad) in str(err.value)


@pytest.mark.parametrize("source", ["./missing.gguf", "/no/such/dir/model.gguf", "~/no-such-model-dir/x",
                                    "missing.gguf", "a/b/c"])
def test_missing_path(source: str) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        load_checkpoint(source)


def test_unknown_name_lists_registry() -> None:
    with pytest.raises(UnknownModelError, match="smollm2-135m-instruct"):
        load_checkpoint("smollm3-instruct")


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(LoadError, match="config.json"):
        load_checkpoint(str(tmp_path))


def test_hub_id_failure_names_id_and_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def offline(repo_id: str, **kwargs):
        raise OSError("no connection")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(LoadError, match=r"'someorg/some-model'.*no connection.*smollm2-135m-instruct"):
        load_checkpoint("someorg/some-model")


def test_hub_id_without_huggingface_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(LoadError, match=r"someorg/some-model.*specdecode\[hub\]"):
        load_checkpoint("someorg/some-model")


def test_hub_snapshot_is_loaded_as_hf_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    config = tiny_config("qwen2")
    tensors = random_tensors(config)
    write_hf_folder(tmp_path / "snap", config, tensors)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kwargs: str(tmp_path / "snap"))
    assert_same_tensors(load_checkpoint("someorg/some-model").tensors, tensors)


def test_registry_name_goes_through_fetch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_config("llama")
    path = write_gguf(tmp_path / "m.gguf", config, random_tensors(config))
    fetched = []
    monkeypatch.setattr(loader, "fetch", lambda model, progress=None: fetched.append(model.name) or path)
    assert load_checkpoint("smollm2-135m-instruct").config == config
    assert fetched == ["smollm2-135m-instruct"]


# ------------------------------------------------------------------------------------------------
# HF folders

def write_hf_folder(folder: Path, config: ModelConfig, tensors: dict[str, torch.Tensor], shards: int = 1,
                    dtype: torch.dtype = torch.float32, extra: dict[str, torch.Tensor] | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config.to_hf()))
    Tokenizer.from_gguf_metadata(tokenizer_metadata()).save(folder)
    items = sorted({**tensors, **(extra or {})}.items())
    if shards == 1:
        save_file({k: v.to(dtype).contiguous() for k, v in items}, str(folder / "model.safetensors"))
        return folder
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = dict(items[i::shards])
        save_file({k: v.to(dtype).contiguous() for k, v in part.items()}, str(folder / name))
        weight_map.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.mark.parametrize("arch, shards", [("llama", 1), ("qwen2", 3)])
def test_hf_folder_round_trip(tmp_path: Path, arch: str, shards: int) -> None:
    config = tiny_config(arch)
    tensors = random_tensors(config)
    folder = write_hf_folder(tmp_path / "m", config, tensors, shards=shards)
    ckpt = load_checkpoint(str(folder))
    assert ckpt.config == config and ckpt.source == str(folder)
    assert_same_tensors(ckpt.tensors, tensors)
    assert ckpt.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]).startswith("<|im_start|>user")


def test_gemma3_gguf_config_and_norm_names(tmp_path: Path) -> None:
    """A Gemma 3 GGUF: the window from its metadata on all but every sixth layer, their RoPE base 10000, the
    embedding scale and four norms per layer under their HF names (llama.cpp's ffn_norm is the pre-MLP one)."""
    config = tiny_config("gemma3")
    tensors = random_tensors(config)
    ckpt = load_checkpoint(str(write_gguf(tmp_path / "g.gguf", config, tensors)))
    assert ckpt.config == config
    for name in ("model.layers.2.pre_feedforward_layernorm.weight", "model.layers.2.post_attention_layernorm.weight",
                 "model.layers.2.post_feedforward_layernorm.weight"):
        assert torch.equal(ckpt.tensors[name], tensors[name]), name


def test_gemma3_hf_folder_gets_its_norm_offset(tmp_path: Path) -> None:
    """transformers' Gemma 3 config round-trips, and the norms (stored as w of x * (1 + w)) load as 1 + w, as a
    GGUF file holds them; the projections load as stored."""
    config = tiny_config("gemma3")
    tensors = random_tensors(config)
    ckpt = load_checkpoint(str(write_hf_folder(tmp_path / "g", config, tensors)))
    assert ckpt.config == config and ckpt.config.window_layers == (True,) * 5 + (False,)
    for name in ("model.norm.weight", "model.layers.5.post_feedforward_layernorm.weight",
                 "model.layers.0.self_attn.q_norm.weight"):
        assert torch.equal(ckpt.tensors[name], tensors[name] + 1.0), name
    assert torch.equal(ckpt.tensors["model.layers.0.mlp.up_proj.weight"], tensors["model.layers.0.mlp.up_proj.weight"])


def test_hf_folder_bf16_tied_head_and_rotary_buffers_dropped(tmp_path: Path) -> None:
    config = tiny_config("llama")
    tensors = random_tensors(config)
    extra = {"lm_head.weight": tensors["model.embed_tokens.weight"],
             "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    folder = write_hf_folder(tmp_path / "m", config, tensors, dtype=torch.bfloat16, extra=extra)
    ckpt = load_checkpoint(str(folder))
    assert_same_tensors(ckpt.tensors, {k: v.to(torch.bfloat16).float() for k, v in tensors.items()})


def test_hf_folder_wrong_shape_and_unexpected_tensor(tmp_path: Path) -> None:
    config = tiny_config("llama")
    tensors = random_tensors(config)
    tensors["model.norm.weight"] = torch.ones(3)
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    folder = write_hf_folder(tmp_path / "m", config, tensors)
    with pytest.raises(LoadError, match=r"unexpected.*q_norm.*wrong shape.*model\.norm\.weight \(3,\)"):
        load_checkpoint(str(folder))


def test_hf_folder_unsupported_model_type(tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path / "m", tiny_config("llama"), {})
    (folder / "config.json").write_text(json.dumps({**tiny_config("llama").to_hf(), "model_type": "gemma"}))
    with pytest.raises(LoadError, match=r"config\.json.*gemma"):
        load_checkpoint(str(folder))


# ------------------------------------------------------------------------------------------------
# The real SmolLM2

@pytest.mark.integration
def test_smollm2_from_registry(smollm2_path: Path) -> None:
    ckpt = load_checkpoint("smollm2-135m-instruct")
    c = ckpt.config
    assert (c.arch, c.num_layers, c.hidden_size, c.head_dim) == ("llama", 30, 576, 64)
    assert (c.num_heads, c.num_kv_heads) == (9, 3)
    assert (c.vocab_size, c.intermediate_size, c.tie_word_embeddings, c.attention_bias) == (49152, 1536, True, False)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert "lm_head.weight" not in ckpt.tensors and len(ckpt.tensors) == 2 + 30 * 9
    assert ckpt.source == str(smollm2_path)
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in ckpt.tensors.values())
    tok = ckpt.tokenizer
    assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!"


@pytest.mark.slow
@pytest.mark.integration
def test_smollm2_weights_match_transformers(smollm2_path: Path) -> None:
    """transformers dequantizes and un-permutes the same file independently (needs accelerate; ~30 s)."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                               dtype=torch.float32).state_dict()
    ours = load_checkpoint(str(smollm2_path)).tensors
    assert set(ref) - set(ours) == {"lm_head.weight"}  # tied: transformers lists the shared head
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref[name]), name
    np.testing.assert_array_equal(ref["lm_head.weight"].numpy(), ours["model.embed_tokens.weight"].numpy())


def test_corrupt_safetensors_and_index_are_named(tmp_path):
    import json as _json

    from specdecode.models.loader import LoadError, load_hf_dir
    from tiny_models import tiny_config

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(_json.dumps(tiny_config("llama").to_hf()))
    (folder / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(LoadError, match="model.safetensors: cannot read safetensors"):
        load_hf_dir(folder)
    (folder / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(LoadError, match="weight_map"):
        load_hf_dir(folder)


def llama_cpp_rope_factors(head_dim: int, theta: float, factor: float, low: float, high: float,
                           old_context: int) -> np.ndarray:
    """``rope_freqs.weight`` as llama.cpp's converter writes it for a Llama 3.x model (each frequency's divisor)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old_context / high:
            out.append(1.0)
        elif wavelen > old_context / low:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_factors_in_a_gguf_scale_rope_as_transformers_llama3_does(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = tiny_config("llama", rope_theta=500.0, num_heads=4, head_dim=16, tie_word_embeddings=False)
    tensors = random_tensors(config, seed=4)
    tensors = {k: (v * 0.1 if "norm" not in k else torch.ones_like(v)) for k, v in tensors.items()}
    factors = llama_cpp_rope_factors(16, 500.0, 8.0, 1.0, 4.0, 32)
    assert len(set(factors.tolist())) > 2  # kept, smoothed and scaled bands all present
    path = write_gguf(tmp_path / "l3.gguf", config, tensors, extra={"rope_freqs.weight": factors})
    ckpt = load_checkpoint(str(path))
    assert ckpt.config.rope_scaling["rope_type"] == "freq_factors" and "rope_freqs.weight" not in ckpt.tensors
    from specdecode.kv.cache import CacheConfig

    ours = from_hf_tensors(ckpt.config, dict(ckpt.tensors))
    hf_config = dataclasses.replace(config, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config.to_hf())).eval()
    hf.load_state_dict(tensors, strict=False)
    ids = torch.randint(0, config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits.float()
    got = ours(ids, ours.new_cache(CacheConfig(max_len=80))).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    plain = from_hf_tensors(config, tensors)  # without the factors: measurably other logits
    assert (plain(ids, plain.new_cache(CacheConfig(max_len=80))).logits - want).abs().max() > 1e-2
