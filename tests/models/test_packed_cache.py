"""packed_cache: a GGUF packed once is read back on the next load as the same model; a damaged, truncated or
stale entry is never trusted (rebuilt, said so); other settings get their own entry; the budget evicts the
least recently used; the switch turns it off."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from tiny_gguf import random_tensors, tiny_config, write_gguf

from specdecode.kv.cache import CacheConfig
from specdecode.models import build, packed_cache
from specdecode.models.build import load_model
from specdecode.models.linear import SplitLinear
from specdecode.models.transformer import Transformer


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(packed_cache.SWITCH_ENV, raising=False)
    monkeypatch.delenv(packed_cache.BUDGET_ENV, raising=False)


@pytest.fixture
def gguf_file(tmp_path) -> Path:
    config = tiny_config("qwen2", num_layers=3)
    return write_gguf(tmp_path / "m.gguf", config, random_tensors(config, seed=2))


def logits(model: Transformer) -> torch.Tensor:
    return model(torch.tensor([[3, 1, 4, 1, 5]]), model.new_cache(CacheConfig(max_len=32))).logits


def entries() -> list[Path]:
    return sorted(packed_cache.folder().glob("*.pt"))


def load(path: Path, **kwargs):
    said: list[str] = []
    loaded = load_model(str(path), dtype="bfloat16", progress=said.append, **kwargs)
    if not loaded.model.backend.packs:
        pytest.skip(f"no packing backend on this CPU ({loaded.model.backend.name})")
    return loaded.model, said


def refuse_packing(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("packed again although a packed model was cached")
    monkeypatch.setattr(build, "packed_from", fail)


def test_second_load_reads_the_packed_model_back(gguf_file, monkeypatch):
    first, said = load(gguf_file)
    assert any("packing m.gguf" in line for line in said) and len(entries()) == 1
    refuse_packing(monkeypatch)
    second, said = load(gguf_file)
    assert not any("packing" in line for line in said)
    assert second.weight_format == first.weight_format and second.backend.name == first.backend.name
    assert torch.equal(logits(second), logits(first))
    for name, tensor in first.state_dict().items():
        assert torch.equal(second.state_dict()[name], tensor), name


@pytest.mark.parametrize("damage", ["flip", "truncate", "no json", "other config"])
def test_a_damaged_entry_is_rebuilt_never_trusted(gguf_file, damage):
    first, _ = load(gguf_file)
    want = logits(first)
    (pt,) = entries()
    meta = pt.with_suffix(".json")
    if damage == "flip":
        data = bytearray(pt.read_bytes())
        data[len(data) // 2] ^= 0x40
        pt.write_bytes(bytes(data))
    elif damage == "truncate":
        pt.write_bytes(pt.read_bytes()[:-100])
    elif damage == "no json":
        meta.unlink()
    else:
        meta.write_text(meta.read_text().replace('"num_layers": 3', '"num_layers": 2'))
    second, said = load(gguf_file)
    if damage in ("flip", "truncate", "other config"):
        assert any("damaged or stale" in line for line in said)
    assert any("packing m.gguf" in line for line in said)
    assert torch.equal(logits(second), want)
    assert len(entries()) == 1 and meta.is_file()
    third, said = load(gguf_file)  # the rewritten entry is good
    assert not any("packing" in line for line in said) and torch.equal(logits(third), want)


def test_other_settings_and_files_get_their_own_entries(gguf_file, tmp_path):
    load(gguf_file)
    load(gguf_file, weights="q8_0")
    assert len(entries()) == 2
    other = tiny_config("qwen2", num_layers=3)
    load(write_gguf(tmp_path / "other.gguf", other, random_tensors(other, seed=3)))
    assert len(entries()) == 3
    copy = tmp_path / "copy.gguf"  # the same bytes under another name: the same entry
    copy.write_bytes(gguf_file.read_bytes())
    _, said = load(copy)
    assert not any("packing" in line for line in said) and len(entries()) == 3


def test_the_budget_evicts_the_least_recently_used(gguf_file, monkeypatch):
    load(gguf_file)
    (oldest,) = entries()
    monkeypatch.setenv(packed_cache.BUDGET_ENV, "0")
    load(gguf_file, weights="q8_0")
    assert entries() != [oldest] and len(entries()) == 1  # the new entry stays, the old one went


def test_switched_off_nothing_is_written(gguf_file, monkeypatch):
    monkeypatch.setenv(packed_cache.SWITCH_ENV, "0")
    load(gguf_file)
    _, said = load(gguf_file)
    assert entries() == [] and not any("packing" in line for line in said)


def test_a_failed_write_leaves_no_entry_and_old_leftovers_are_removed(gguf_file, monkeypatch):
    import os
    import time

    real_save = torch.save

    def full_disk(*args, **kwargs):
        raise RuntimeError("PytorchStreamWriter failed writing file data: No space left on device")
    monkeypatch.setattr(torch, "save", full_disk)
    _, said = load(gguf_file)
    assert any("could not write the packed model" in line for line in said)
    assert entries() == [] and list(packed_cache.folder().glob(".*.tmp")) == []
    monkeypatch.setattr(torch, "save", real_save)
    stale = packed_cache.folder() / ".gone.pt.1-2.tmp"
    orphan = packed_cache.folder() / "orphan.pt"
    for path in (stale, orphan):
        path.write_bytes(b"x")
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    load(gguf_file)
    assert not stale.exists() and not orphan.exists() and len(entries()) == 1


def test_other_conversion_code_makes_another_entry(gguf_file, monkeypatch):
    load(gguf_file)
    monkeypatch.setattr(packed_cache, "conversion_digest", lambda: "0" * 12)
    _, said = load(gguf_file)
    assert any("packing m.gguf" in line for line in said) and len(entries()) == 2


@pytest.mark.parametrize("value", ["abc", "-1", "nan"])
def test_a_bad_budget_is_refused_by_name_before_packing(gguf_file, monkeypatch, value):
    monkeypatch.setenv(packed_cache.BUDGET_ENV, value)
    with pytest.raises(ValueError, match="SPECDECODE_PACKED_CACHE_GB=.*a number >= 0"):
        load(gguf_file)
    assert entries() == []


def test_a_projection_of_parts_in_formats_of_their_own_is_read_back(tmp_path, monkeypatch):
    """A Q4_K_M-like file: Q4_K q and k beside a Q6_K v make one projection of two parts (``SplitLinear``)."""
    config = tiny_config("qwen2", num_layers=2, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                         head_dim=64)
    q4_k, q6_k = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    qtypes = {f"model.layers.{i}.self_attn.{n}_proj.weight": q6_k if n == "v" else q4_k
              for i in range(config.num_layers) for n in "qkv"}
    path = write_gguf(tmp_path / "split.gguf", config, random_tensors(config, seed=4), qtypes=qtypes)
    first, _ = load(path)
    assert isinstance(first.layers[0].wqkv, SplitLinear) and first.layers[0].wqkv.formats == ["q4_k", "q6_k"]
    refuse_packing(monkeypatch)
    second, said = load(path)
    assert not any("packing" in line for line in said)
    assert isinstance(second.layers[1].wqkv, SplitLinear) and second.layers[1].wqkv.formats == ["q4_k", "q6_k"]
    assert torch.equal(logits(second), logits(first))
