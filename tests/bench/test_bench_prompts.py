"""The benchmark's packaged suites, selection, and the command refusing a bad prompt file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdecode.bench.prompts import CATEGORIES, default_prompts, select
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
