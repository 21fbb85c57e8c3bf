"""Head files made into drafters: the kind's drafter over the chosen draft vocabulary, and a clear error
for a file made for another model or with ids outside the target's vocabulary."""

from __future__ import annotations

import pytest

from specdecode.drafters.head_loader import load_head_drafter
from specdecode.heads.file import HeadFileError
from tiny_models import tiny_model, write_head_file


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_a_head_file_becomes_its_kinds_drafter_over_the_chosen_vocabulary(tmp_path, target, kind):
    path = write_head_file(tmp_path / "h.safetensors", kind, target, vocab=[0, 5, 9], seed=3)
    drafter = load_head_drafter(path, target)
    assert drafter.name == kind and drafter.vocab.ids.tolist() == [0, 5, 9]
    assert load_head_drafter(path, target, draft_vocab=2).vocab.ids.tolist() == [0, 5]
    assert load_head_drafter(path, target, draft_vocab=0).vocab.ids.numel() == 97


@pytest.mark.parametrize("change, what", [
    (dict(hidden_size=32, num_heads=2, num_kv_heads=1), "hidden size 64"),
    (dict(vocab_size=101), "vocabulary size 97"),
    (dict(num_layers=3), "layer count 4"),
    ({}, "weights fingerprint"),  # same shapes, other weights
])
def test_a_head_for_another_model_is_refused_naming_the_mismatch(tmp_path, target, change, what):
    path = write_head_file(tmp_path / "h.safetensors", "eagle", target)
    other = tiny_model("llama", seed=1, **change)
    with pytest.raises(HeadFileError, match=rf"h\.safetensors: head was trained for a model with {what}"):
        load_head_drafter(path, other)


def test_vocabulary_ids_outside_the_target_are_refused(tmp_path, target):
    path = write_head_file(tmp_path / "h.safetensors", "medusa", target, vocab=[0, 97])
    with pytest.raises(HeadFileError, match=r"draft vocabulary ids must lie in 0\.\.96"):
        load_head_drafter(path, target)
