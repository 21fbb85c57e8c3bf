"""The benchmark's packaged suites, selection, and the command refusing a bad prompt file."""

from __future__ import annotations

import json
import re
from itertools import groupby
from pathlib import Path

import pytest

from specdecode.bench.prompts import CATEGORIES, EXTRA_SUITES, default_prompts, packaged_prompts, select
from specdecode.cli import main
from specdecode.prompts import Prompt


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_packaged_suites_cover_every_category_with_ten_prompts_or_more():
    prompts = default_prompts()
    counts = {c: sum(p.category == c for p in prompts) for c in CATEGORIES}
    assert set(CATEGORIES) >= {"multi_turn", "translation", "summarization", "qa", "math_reasoning", "rag", "code"}
    assert all(n >= 10 for n in counts.values()), counts
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.messages is not None for p in prompts if p.category == "multi_turn")
    assert all(len(p.messages) >= 3 for p in prompts if p.category == "multi_turn")
    assert all("Passage:" in p.prompt for p in prompts if p.category == "rag")


def test_default_prompts_are_the_seven_standard_suites_only():
    assert CATEGORIES == ("multi_turn", "translation", "summarization", "qa", "math_reasoning", "rag", "code")
    assert not set(CATEGORIES) & set(EXTRA_SUITES)
    prompts = default_prompts()
    assert list(dict.fromkeys(p.category for p in prompts)) == list(CATEGORIES)
    assert prompts == packaged_prompts(CATEGORIES)
    assert all(p.prediction is None for p in prompts)


@pytest.mark.parametrize("suite", CATEGORIES + EXTRA_SUITES)
def test_every_packaged_suite_parses_with_its_name_as_category(suite):
    prompts = packaged_prompts([suite])
    assert prompts and {p.category for p in prompts} == {suite}


def test_packaged_prompts_keeps_the_given_order_and_refuses_unknown_names():
    prompts = packaged_prompts(["agentic", "code", "edit"])
    assert list(dict.fromkeys(p.category for p in prompts)) == ["agentic", "code", "edit"]
    assert len({p.id for p in prompts}) == len(prompts)
    with pytest.raises(ValueError, match=r"no packaged suite \['edits'\]; available: .*'code'.*'edit', 'agentic'"):
        packaged_prompts(["code", "edits"])


def _last_user_text(p: Prompt) -> str:
    return p.prompt if p.prompt is not None else p.messages[-1]["content"]


def test_edit_suite_predictions_are_the_originals_inside_the_prompts():
    prompts = packaged_prompts(["edit"])
    assert len(prompts) >= 24
    assert [p.id for p in prompts] == [f"edit-{i:02d}" for i in range(1, len(prompts) + 1)]
    for p in prompts:
        assert p.prediction is not None, p.id
        assert p.prediction in _last_user_text(p), p.id
        assert "in full, with no explanation" in _last_user_text(p), p.id
        assert 3 <= len(p.prediction.splitlines()) <= 60, p.id
    assert len({p.prediction for p in prompts}) == len(prompts)


def test_agentic_suite_is_sequences_of_ten_or_more_requests_sharing_their_instructions():
    prompts = packaged_prompts(["agentic"])
    assert all(p.prediction is None and p.messages is not None for p in prompts)
    sequences: dict[str, list[tuple[int, Prompt]]] = {}
    for p in prompts:
        match = re.fullmatch(r"agentic-([a-z]+)-(\d{2})", p.id)
        assert match, p.id
        sequences.setdefault(match[1], []).append((int(match[2]), p))
    assert len(sequences) >= 3
    # a sequence's requests are contiguous in the file (file order is replay order) and numbered from 01
    names_in_file_order = [re.fullmatch(r"agentic-([a-z]+)-\d{2}", p.id)[1] for p in prompts]
    assert [name for name, _ in groupby(names_in_file_order)] == list(sequences)
    for name, requests in sequences.items():
        assert len(requests) >= 10, name
        assert [n for n, _ in requests] == list(range(1, len(requests) + 1)), name
        systems = {p.messages[0]["content"] for _, p in requests}
        assert len(systems) == 1 and all(p.messages[0]["role"] == "system" for _, p in requests), name
        assert len({_last_user_text(p) for _, p in requests}) == len(requests), name


def test_select_limits_per_category_and_filters():
    prompts = [Prompt(f"{c}{i}", c, prompt="p") for c in ("a", "b") for i in range(3)]
    assert [p.id for p in select(prompts, limit=2)] == ["a0", "a1", "b0", "b1"]
    assert [p.id for p in select(prompts, ["b"], 1)] == ["b0"]
    assert select(prompts) == prompts
    with pytest.raises(ValueError, match=r"no prompts in \['c'\]"):
        select(prompts, ["a", "c"])


def test_cli_rejects_a_malformed_file_before_loading_anything(tmp_path, capsys):
    path = _write(tmp_path, [json.dumps({"id": "a", "category": "qa", "prompt": "p"}), "{oops"])
    status = main(["bench", "--model", str(tmp_path / "no-such-model"), "--prompts", str(path), "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2
    assert f"{path}:2: not valid JSON" in err
    assert "loading" not in err  # nothing ran: the model was never touched


def test_structured_suite_has_twenty_or_more_schemas_that_compile_strictly():
    from distribution_check import small_vocab_tokenizer
    from specdecode.grammar import Grammar, GrammarCompiler

    prompts = packaged_prompts(["structured"])
    assert len(prompts) >= 20 and len({p.schema for p in prompts}) == len(prompts)
    tokenizer = small_vocab_tokenizer()
    compiler = GrammarCompiler(tokenizer.backend.to_str(), 16, tokenizer.eos_token_ids)
    for p in prompts:
        schema = json.loads(p.schema)
        assert schema["type"] == "object" and schema["required"], p.id
        compiler.compile(Grammar.json_schema(schema, strict=True))  # every keyword enforced, none ignored
