"""The newcomer's test: a drafter is one new file plus one line that imports it (``toy_drafter.py``, shown in
``docs/architecture.md`` §7). Imported into a copy of the registry, the toy reaches ``generate --drafter`` and
passes the conformance suite's checks with no change anywhere else; the real registry never sees it."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

import test_conformance as conformance
from specdecode.cli import main
from specdecode.drafters import registry
from tiny_models import write_tiny_hf_model

TOY = Path(__file__).with_name("toy_drafter.py")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def toy(monkeypatch):
    """Registers the toy in a copy of the registry, as ``drafters/__init__.py``'s import line would."""
    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))
    monkeypatch.delitem(sys.modules, "toy_drafter", raising=False)
    importlib.import_module("toy_drafter")
    yield "repeat"
    monkeypatch.delitem(sys.modules, "toy_drafter", raising=False)


def test_the_toy_is_one_small_file_that_registers_itself(toy):
    assert toy in registry.names() and registry.names()[-1] == toy  # registered last, listed last
    assert len(TOY.read_text().splitlines()) <= 35
    documented = Path(__file__).parents[2] / "docs" / "architecture.md"
    assert f"`tests/drafters/toy_drafter.py` ({len(TOY.read_text().splitlines())} lines)" in documented.read_text()


@pytest.mark.parametrize("setting", conformance.CACHE_SETTINGS)  # all five, as every drafter
def test_the_toy_passes_the_conformance_checks(toy, target, draft_model, plain, tmp_path, setting):
    conformance.test_greedy_tokens_are_plain_decodings_alone_and_batched(target, draft_model, plain, tmp_path, toy,
                                                                         False, setting)


def test_the_toy_keeps_the_targets_distribution(toy, tmp_path):
    conformance.test_sampled_tokens_follow_the_targets_distribution(tmp_path, toy, False)


def test_the_toy_is_a_drafter_choice_of_generate(toy, tmp_path, capsys):
    model = write_tiny_hf_model(tmp_path / "target", seed=0)
    argv = ["generate", "--model", str(model), "--threads", "1", "--dtype", "float32", "--json",
            "--max-new-tokens", "16"]
    prompt = "the the the the cat sat"
    assert main([*argv, "--drafter", "none", prompt]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, "--drafter", toy, prompt]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert drafted["token_ids"] == plain["token_ids"] and drafted["stats"]["drafted_tokens"] > 0


# The conformance suite's fixtures, shared rather than written again.
target, draft_model, plain = conformance.target, conformance.draft_model, conformance.plain
