"""Greedy speculative decoding on the real SmolLM2 is token-identical to plain decoding, per drafter."""

from __future__ import annotations

import pytest
import torch

from specdecode.drafters import LayerSkipDrafter, NgramDrafter
from specdecode.engine import Engine, SpeculativeConfig
from kernel_paths import NATIVE_PATHS, path_params
from real_prompts import ALL

pytestmark = pytest.mark.integration

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def prompts(smollm2):
    tok = smollm2.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in ALL]


@pytest.fixture(scope="module")
def plain(smollm2, prompts):
    engine = Engine(smollm2.model, smollm2.tokenizer)
    # eos disabled so that every prompt really produces NEW_TOKENS tokens.
    return [engine.generate(p, max_new_tokens=NEW_TOKENS, eos_token_ids=()).token_ids for p in prompts]


# n-gram drafting with the default controller in the default suite (layerskip: on every kernel path below);
# the other drafter/gamma pairs with `-m slow`.
@pytest.mark.parametrize("kind,gamma", [pytest.param("ngram", 4, marks=pytest.mark.slow),
                                        pytest.param("ngram", "agreement", marks=pytest.mark.slow),
                                        ("ngram", "adaptive"), pytest.param("layerskip", 3, marks=pytest.mark.slow),
                                        pytest.param("layerskip", "confidence", marks=pytest.mark.slow)])
def test_greedy_speculation_is_identical_to_plain(smollm2, prompts, plain, kind, gamma):
    model = smollm2.model
    # Any skip set must give identical output; this one drafts with 2/3 of the layers.
    drafter = NgramDrafter() if kind == "ngram" else LayerSkipDrafter(model, skip=list(range(4, 26, 3)))
    engine = Engine(model, smollm2.tokenizer, drafter, SpeculativeConfig(gamma=gamma))
    accepted = 0
    # layerskip drafts with 20 of the 30 layers, so its cases cost twice ngram's: half the prompts do.
    cases = list(zip(prompts, plain))[:None if kind == "ngram" else len(prompts) // 2]
    for prompt, expected in cases:
        result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_ids=())
        assert len(result.token_ids) == NEW_TOKENS
        assert result.token_ids == expected
        accepted += result.stats.accepted_tokens
    assert accepted > 0  # the drafts were really verified, not all rejected


# oneDNN and F.linear are not the default on any x86-64 CPU with AVX2: their cases run with `-m slow`.
@pytest.mark.parametrize("path", [p if p.values[0] in NATIVE_PATHS else pytest.param(*p.values, marks=[*p.marks,
                                                                                                    pytest.mark.slow])
                                  for p in path_params()])
def test_greedy_speculation_is_identical_to_plain_on_every_kernel_path(smollm2_on, path):
    """The exactness claim on each path this CPU can run (the default path is also covered above)."""
    lm = smollm2_on(path)
    tok = lm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in ALL[:2]]
    assert lm.model.backend.name == path and lm.model.dtype == torch.bfloat16
    plain = [Engine(lm.model, tok).generate(p, max_new_tokens=32, eos_token_ids=()).token_ids for p in prompts]
    for drafter, gamma in [(NgramDrafter(), 4), (LayerSkipDrafter(lm.model, skip=list(range(4, 26, 3))), 7)]:
        engine = Engine(lm.model, tok, drafter, SpeculativeConfig(gamma=gamma))
        results = [engine.generate(p, max_new_tokens=32, eos_token_ids=()) for p in prompts]
        assert [r.token_ids for r in results] == plain, (path, drafter.name)
        assert sum(r.stats.accepted_tokens for r in results) > 0
