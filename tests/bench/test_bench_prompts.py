"""Prompt files: validation with line numbers, the packaged suites, selection and rendering."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdecode.bench.prompts import (CATEGORIES, Prompt, PromptFileError, default_prompts, load_prompts,
                                      render, select)
from specdecode.cli import main


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


def test_packaged_suites_cover_every_category_with_ten_prompts_or_more():
    prompts = default_prompts()
    counts = {c: sum(p.category == c for p in prompts) for c in CATEGORIES}
    assert set(CATEGORIES) >= {"multi_turn", "translation", "summarization", "qa", "math_reasoning", "rag", "code"}
    assert all(n >= 10 for n in counts.values()), counts
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.messages is not None for p in prompts if p.category == "multi_turn")
    assert all(len(p.messages) >= 3 for p in prompts if p.category == "multi_turn")
    assert all("Passage:" in p.prompt for p in prompts if p.category == "rag")


def test_select_limits_per_category_and_filters():
    prompts = [Prompt(f"{c}{i}", c, prompt="p") for c in ("a", "b") for i in range(3)]
    assert [p.id for p in select(prompts, limit=2)] == ["a0", "a1", "b0", "b1"]
    assert [p.id for p in select(prompts, ["b"], 1)] == ["b0"]
    assert select(prompts) == prompts
    with pytest.raises(ValueError, match=r"no prompts in \['c'\]"):
        select(prompts, ["a", "c"])


class _FakeTokenizer:
    def __init__(self, template: str | None) -> None:
        self.chat_template = template
        self.calls: list[tuple[str, bool]] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.calls.append((text, add_special_tokens))
        return [len(text)]

    def apply_chat_template(self, messages):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_render_wraps_plain_prompts_in_the_chat_template_by_default():
    tok = _FakeTokenizer("a template")
    render(Prompt("a", "qa", prompt="Hi"), tok)
    render(Prompt("b", "qa", prompt="Hi"), tok, chat=False)
    render(Prompt("c", "qa", messages=({"role": "user", "content": "Q"},)), tok, chat=False)
    assert tok.calls == [("<user>Hi<assistant>", False), ("Hi", True), ("<user>Q<assistant>", False)]


def test_render_without_a_template():
    tok = _FakeTokenizer(None)
    render(Prompt("a", "qa", prompt="Hi"), tok)
    render(Prompt("b", "qa", messages=({"role": "system", "content": "S"}, {"role": "user", "content": "Q"})), tok)
    assert tok.calls == [("Hi", True), ("system: S\nuser: Q\nassistant:", True)]


def test_cli_rejects_a_malformed_file_before_loading_anything(tmp_path, capsys):
    path = _write(tmp_path, [json.dumps({"id": "a", "category": "qa", "prompt": "p"}), "{oops"])
    status = main(["bench", "--model", str(tmp_path / "no-such-model"), "--prompts", str(path), "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2
    assert f"{path}:2: not valid JSON" in err
    assert "loading" not in err  # nothing ran: the model was never touched
