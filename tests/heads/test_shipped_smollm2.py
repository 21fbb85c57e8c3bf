"""The heads shipped for SmolLM2: found for the model however it is loaded, small, trained (they draft
well), and greedy speculation with them is token-identical to plain decoding, compressed caches included."""

from __future__ import annotations

import pytest

from specdecode.drafters import DrafterInputs, registry
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.heads import shipped_head, shipped_heads
from specdecode.kv.cache import CacheConfig
from real_prompts import ALL, GROUNDED

pytestmark = pytest.mark.integration
NEW_TOKENS = 64


def _ids(tok, text):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def test_shipped_heads_are_small_and_found_by_the_models_weights(smollm2):
    assert {p.name for p in shipped_heads()} >= {"smollm2-135m-instruct.eagle.safetensors",
                                                   "smollm2-135m-instruct.medusa.safetensors"}
    for path in shipped_heads():
        assert path.stat().st_size <= 20 * 2**20, path
    assert shipped_head(smollm2.model, "eagle").name == "smollm2-135m-instruct.eagle.safetensors"
    assert shipped_head(smollm2.model, "medusa").name == "smollm2-135m-instruct.medusa.safetensors"


@pytest.fixture(scope="module")
def prompts(smollm2):
    return [_ids(smollm2.tokenizer, text) for text in ALL[:4]]


@pytest.fixture(scope="module")
def plain(smollm2, prompts):
    engine = Engine(smollm2.model, smollm2.tokenizer)
    return [engine.generate(p, max_new_tokens=NEW_TOKENS, eos_token_ids=()).token_ids for p in prompts]


# An untrained head stays at tau 1.0 (nothing accepted); the shipped ones reached 1.5 (eagle, gamma 3) and
# 1.2 (medusa) on the bench suites.
@pytest.mark.parametrize("kind, gamma, min_tau", [("eagle", 4, 1.25), ("eagle", "adaptive", 1.0), ("medusa", 3, 1.05)])
def test_greedy_speculation_with_a_shipped_head_is_identical_to_plain(smollm2, prompts, plain, kind, gamma, min_tau):
    model, tok = smollm2.model, smollm2.tokenizer
    drafter = registry.build(kind, DrafterInputs(target=model, head=shipped_head(model, kind)))
    engine = Engine(model, tok, drafter, SpeculativeConfig(gamma=gamma))
    emitted = forwards = 0
    for prompt, expected in zip(prompts, plain):
        result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_ids=())
        assert result.token_ids == expected
        emitted, forwards = emitted + len(result.token_ids), forwards + result.stats.target_forwards
    assert emitted / forwards > min_tau


@pytest.mark.parametrize("cache", [CacheConfig(kv_dtype="int8", group_size=16, residual=16),
                                   CacheConfig(window=24, sinks=4, evict_chunk=8)], ids=["int8", "window"])
def test_eagle_under_a_compressed_cache_is_identical_to_plain(smollm2, cache):
    model, tok = smollm2.model, smollm2.tokenizer
    prompt = _ids(tok, GROUNDED[0])
    plain = Engine(model, tok, cache=cache).generate(prompt, max_new_tokens=48, eos_token_ids=())
    drafter = registry.build("eagle", DrafterInputs(target=model, head=shipped_head(model, "eagle"),
                                                    draft_cache=cache))
    result = Engine(model, tok, drafter, SpeculativeConfig(gamma=4), cache=cache).generate(
        prompt, max_new_tokens=48, eos_token_ids=())
    assert result.token_ids == plain.token_ids
    assert result.stats.accepted_tokens > 0
