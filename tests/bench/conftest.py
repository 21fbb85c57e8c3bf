"""Tiny random-weight models written as HF folders, so `specdecode bench --model DIR` runs in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiny_models import write_tiny_hf_model


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(target, draft): two tiny llama folders with the same tokenizer and different random weights."""
    root = tmp_path_factory.mktemp("bench-models")
    return write_tiny_hf_model(root / "target", seed=0), write_tiny_hf_model(root / "draft", seed=1)
