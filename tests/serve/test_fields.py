"""fields.py: OpenAI fields that ask for what this server does not do are refused by name, fields at their
defaults or without effect pass, unknown ones are logged once, and text that is not Unicode is found by path."""

from __future__ import annotations

import logging

import pytest

from specdecode.serve import fields
from specdecode.serve.fields import check_extra_fields, first_unencodable, unencodable_text


@pytest.mark.parametrize("extra, name", [
    ({"tools": [{"type": "function"}]}, "tools"), ({"suffix": "end"}, "suffix"),
    ({"guided_regex": "a+"}, "guided_regex"),
    ({"echo": True}, "echo"), ({"best_of": 2}, "best_of"), ({"min_tokens": 3}, "min_tokens"),
    ({"audio": {"voice": "x"}}, "audio"), ({"ignore_eos": True}, "ignore_eos"), ({"guided_json": {}}, "guided_json"),
    ({"user": "u", "functions": [{"name": "f"}]}, "functions"),
])
def test_fields_asking_for_what_is_not_done_are_refused_by_name(extra, name):
    refused = check_extra_fields(extra)
    assert refused is not None and refused[0] == name and "not supported" in refused[1]


def test_defaults_and_fields_without_effect_pass():
    assert check_extra_fields({"tools": [], "tool_choice": "none", "best_of": 1,
                               "user": "u", "store": True, "metadata": {"a": "b"}, "parallel_tool_calls": True}) is None
    assert check_extra_fields({"echo": 0}) is not None  # 0 is not False here


def test_unknown_fields_are_logged_once_and_ignored(caplog, monkeypatch):
    monkeypatch.setattr(fields, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="specdecode.serve"):
        assert check_extra_fields({"frobnicate": 1}) is None
        assert check_extra_fields({"frobnicate": 2}) is None
    assert [r.getMessage() for r in caplog.records] == ["ignoring the unknown request field 'frobnicate' (logged once)"]


def test_the_first_text_that_is_not_unicode_is_named_by_its_path():
    assert first_unencodable({"messages": [{"content": "ok"}, {"content": ["a", "b\udfff"]}]}) == "messages.1.content.1"
    assert first_unencodable({"prompt": "fine", "stop": ["x"]}) is None
    assert first_unencodable("\ud800") == "body"


def test_unknown_names_are_logged_up_to_a_bound(caplog, monkeypatch):
    monkeypatch.setattr(fields, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="specdecode.serve"):
        for i in range(fields.MAX_LOGGED + 10):
            check_extra_fields({f"field_{i}" + "x" * 100: 1})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == fields.MAX_LOGGED + 1 and lines[-1].startswith("ignoring further unknown")
    assert all(len(line) < 120 for line in lines)  # long names are shortened


def test_only_text_that_reaches_the_tokenizer_is_checked():
    assert unencodable_text({"prompt": [1, 2, 3], "stop": ["a", "\ud800"]}) == "stop.1"
    assert unencodable_text({"messages": [{"role": "user", "content": "\udfff"}]}) == "messages.0.content"
    assert unencodable_text({"prompt": "fine", "user": "\udfff"}) is None  # an ignored field
