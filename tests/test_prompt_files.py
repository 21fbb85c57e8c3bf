"""Prompt files: validation with line numbers, and rendering to token ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdecode.prompts import Prompt, PromptFileError, load_prompts, render


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_valid_file_with_prompts_messages_blank_lines_and_extra_keys(tmp_path):
    path = _write(tmp_path, [
        json.dumps({"id": "a", "category": "qa", "prompt": "Why?", "reference": "ignored"}),
        "",
        json.dumps({"id": 7, "category": "my own category", "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye?"}]}),
    ])
    prompts = load_prompts(path)
    assert prompts == [
        Prompt("a", "qa", prompt="Why?"),
        Prompt("7", "my own category", messages=(
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye?"})),
    ]


def test_prediction_is_optional_and_carried_verbatim(tmp_path):
    original = "def f(x):\n    return x + 1\n"
    path = _write(tmp_path, [
        json.dumps({"id": "a", "category": "edit", "prompt": f"Rename x.\n\n{original}", "prediction": original}),
        json.dumps({"id": "b", "category": "edit", "messages": [{"role": "user", "content": "Fix it."}],
                    "prediction": "  kept as is  "}),
        json.dumps({"id": "c", "category": "qa", "prompt": "Why?"}),
    ])
    a, b, c = load_prompts(path)
    assert a == Prompt("a", "edit", prompt=f"Rename x.\n\n{original}", prediction=original)
    assert b.prediction == "  kept as is  " and b.messages == ({"role": "user", "content": "Fix it."},)
    assert c.prediction is None


@pytest.mark.parametrize("bad, reason", [
    ('{"id": "x", "category": "qa", "prompt": "unterminated', "not valid JSON"),
    ('["a", "list"]', "expected a JSON object"),
    ('{"category": "qa", "prompt": "p"}', "missing key 'id'"),
    ('{"id": "x", "prompt": "p"}', "missing key 'category'"),
    ('{"id": "x", "category": "qa"}', "exactly one of 'prompt' or 'messages'"),
    ('{"id": "x", "category": "qa", "prompt": "p", "messages": []}', "exactly one of 'prompt' or 'messages'"),
    ('{"id": "x", "category": "qa", "prompt": "   "}', "'prompt' must be a non-empty string"),
    ('{"id": "", "category": "qa", "prompt": "p"}', "'id' must be a non-empty string"),
    ('{"id": "x", "category": 3, "prompt": "p"}', "'category' must be a non-empty string"),
    ('{"id": "x", "category": "qa", "messages": []}', "'messages' must be a non-empty list"),
    ('{"id": "x", "category": "qa", "messages": [{"role": "user"}]}', "messages[0] must be an object"),
    ('{"id": "x", "category": "qa", "messages": [{"role": "bot", "content": "c"}]}', "messages[0].role is 'bot'"),
    ('{"id": "x", "category": "qa", "messages": [{"role": "user", "content": "q"}, '
     '{"role": "assistant", "content": "a"}]}', "last message must have role 'user'"),
    ('{"id": "x", "category": "edit", "prompt": "p", "prediction": 3}', "'prediction' must be a non-empty string"),
    ('{"id": "x", "category": "edit", "prompt": "p", "prediction": null}', "'prediction' must be a non-empty string"),
    ('{"id": "x", "category": "edit", "prompt": "p", "prediction": ""}', "'prediction' must be a non-empty string"),
    ('{"id": "x", "category": "edit", "messages": [{"role": "user", "content": "q"}], "prediction": " \\n "}',
     "'prediction' must be a non-empty string"),
    ('{"id": "x", "category": "edit", "prompt": "p", "prediction": ["a"]}', "'prediction' must be a non-empty string"),
])
def test_malformed_line_is_reported_with_its_line_number(tmp_path, bad, reason):
    good = json.dumps({"id": "ok", "category": "qa", "prompt": "fine"})
    path = _write(tmp_path, [good, "", bad, good.replace('"ok"', '"ok2"')])
    with pytest.raises(PromptFileError) as info:
        load_prompts(path)
    message = str(info.value)
    assert f"{path}:3: " in message and reason in message
    assert "nothing was run" in message
    assert ":1:" not in message and ":4:" not in message


def test_every_bad_line_is_listed_and_duplicates_point_to_the_first(tmp_path):
    line = json.dumps({"id": "a", "category": "qa", "prompt": "p"})
    path = _write(tmp_path, [line, "nonsense", line])
    message = str(pytest.raises(PromptFileError, load_prompts, path).value)
    assert "2 bad line(s)" in message
    assert ":2: not valid JSON" in message
    assert ":3: duplicate id 'a' (first on line 1)" in message


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file_is_an_error(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(PromptFileError, match="no prompts"):
        load_prompts(path)


def test_not_utf8_is_an_error(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"id": "a", "category": "qa", "prompt": "caf\xe9"}\n')
    with pytest.raises(PromptFileError, match="not UTF-8"):
        load_prompts(path)


class _FakeTokenizer:
    def __init__(self, template: str | None) -> None:
        self.chat_template = template
        self.calls: list[str] = []

    def encode_prompt(self, text: str) -> list[int]:
        self.calls.append(text)
        return [len(text)]

    def apply_chat_template(self, messages):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_render_wraps_plain_prompts_in_the_chat_template_by_default():
    tok = _FakeTokenizer("a template")
    render(Prompt("a", "qa", prompt="Hi"), tok)
    render(Prompt("b", "qa", prompt="Hi"), tok, chat=False)
    render(Prompt("c", "qa", messages=({"role": "user", "content": "Q"},)), tok, chat=False)
    assert tok.calls == ["<user>Hi<assistant>", "Hi", "<user>Q<assistant>"]


def test_render_without_a_template():
    tok = _FakeTokenizer(None)
    render(Prompt("a", "qa", prompt="Hi"), tok)
    render(Prompt("b", "qa", messages=({"role": "system", "content": "S"}, {"role": "user", "content": "Q"})), tok)
    assert tok.calls == ["Hi", "system: S\nuser: Q\nassistant:"]
