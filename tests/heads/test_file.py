"""Head files: round trip, and one clear error for every way a file can be unusable."""

from __future__ import annotations

import pytest
import torch

from specdecode.heads.file import HeadFileError, load_head, save_head
from tiny_models import tiny_model, write_head_file


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_round_trip_keeps_weights_vocabulary_and_metadata(tmp_path, target, kind):
    path = write_head_file(tmp_path / "h.safetensors", kind, target, vocab=[0, 5, 9], seed=3)
    head = load_head(path)
    assert head.kind == kind and head.vocab[:3].tolist() == [0, 5, 9] and head.recipe == {"test": True}
    assert head.target["hidden_size"] == 64 and head.target["vocab_size"] == 97
    assert head.draft_vocab == 3 and head.vocab.numel() == 97  # every id ranked; the trained size first


def test_a_changed_byte_is_a_checksum_mismatch(tmp_path, target):
    path = write_head_file(tmp_path / "h.safetensors", "medusa", target)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # inside the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(HeadFileError, match=r"h\.safetensors: checksum mismatch"):
        load_head(path)


def test_a_truncated_file_names_the_file(tmp_path, target):
    path = write_head_file(tmp_path / "h.safetensors", "eagle", target)
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(HeadFileError, match=r"h\.safetensors: (not a readable|corrupt) head file"):
        load_head(path)


def test_missing_file_and_foreign_file(tmp_path):
    with pytest.raises(HeadFileError, match="no such head file"):
        load_head(tmp_path / "nope.safetensors")
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(HeadFileError, match="not a specdecode head file"):
        load_head(tmp_path / "other.safetensors")


def test_an_interrupted_save_leaves_neither_file_nor_temporary(tmp_path, target, monkeypatch):
    import specdecode.heads.file as file_module

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    head = load_head(write_head_file(tmp_path / "ok.safetensors", "medusa", target))
    monkeypatch.setattr(file_module, "save_file", fail)
    with pytest.raises(KeyboardInterrupt):
        save_head(tmp_path / "new.safetensors", head)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.safetensors"]
