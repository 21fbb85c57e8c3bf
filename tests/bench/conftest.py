"""Tiny random-weight models written as HF folders, so `specdecode bench --model DIR` runs in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from tiny_models import random_hf_tensors, tiny_config

WORDS = ("the a cat dog sat on mat and ran to park big small red blue green one two three four five six "
         "seven eight nine ten is was were be it this that what why how who when where write code def return "
         "if else for in print list dict sum add sort text word short long summary translate french german "
         "answer question passage math plus minus times equal number prime function python function_name "
         "value key loop while true false none yes no good bad happy sad fast slow up down left right day "
         "night sun moon star tree house car road city town river sea sky").split()


def write_tiny_hf_model(folder: Path, seed: int = 0, arch: str = "llama") -> Path:
    """config.json + model.safetensors + tokenizer.json (WordLevel, whitespace) + tokenizer_config.json."""
    config = tiny_config(arch)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config.to_hf()))
    tensors = random_hf_tensors(config, seed=seed)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    vocab = {"<eos>": 0, "[UNK]": 1}
    for w in dict.fromkeys(WORDS):
        if len(vocab) < config.vocab_size:
            vocab[w] = len(vocab)
    assert len(vocab) <= config.vocab_size
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return folder


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(target, draft): two tiny llama folders with the same tokenizer and different random weights."""
    root = tmp_path_factory.mktemp("bench-models")
    return write_tiny_hf_model(root / "target", seed=0), write_tiny_hf_model(root / "draft", seed=1)
