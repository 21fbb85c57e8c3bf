"""Greedy speculation on the real SmolLM2 stays token-identical to plain decoding under an int8 cache and a
sliding window (the same compression for both), with the compression really in effect."""

from __future__ import annotations

import pytest

from specdecode.drafters import LayerSkipDrafter, NgramDrafter
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.kv.cache import CacheConfig
from kernel_paths import path_params
from real_prompts import GROUNDED

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

NEW_TOKENS = 48
# The torch path (bf16 projections in plain float math) is the slowest by far: half as many tokens there, still
# two int8 flushes and two evictions while generating.
NEW_TOKENS_ON = {"torch": 24}
SETTINGS = {
    # A 60-token chat prompt + 48 tokens: three int8 groups are flushed while generating (two in 24 tokens).
    "int8": CacheConfig(kv_dtype="int8", group_size=16, residual=16),
    # Far past the window: tokens are evicted every 8 verified tokens, during prefill and generation.
    "window": CacheConfig(window=24, sinks=4, evict_chunk=8),
}


def _full_bytes_per_token(model) -> int:
    """What an uncompressed cache holds per token in the model's own dtype (bf16 or float32, by the CPU)."""
    c = model.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * model.dtype.itemsize  # keys + values


@pytest.mark.parametrize("path", path_params())
@pytest.mark.parametrize("setting, drafter", [("int8", "ngram"), ("window", "layerskip")])
def test_greedy_speculation_is_identical_to_plain_under_compression(smollm2_on, path, setting, drafter):
    lm = smollm2_on(path)
    model, tok = lm.model, lm.tokenizer
    cache, new_tokens = SETTINGS[setting], NEW_TOKENS_ON.get(path, NEW_TOKENS)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": GROUNDED[0]}]))
    plain = Engine(model, tok, cache=cache).generate(prompt, max_new_tokens=new_tokens, eos_token_ids=())
    # int8: about 0.7x of bf16 here (float32 scales, 16 recent tokens in bf16); the window: far less.
    assert plain.stats.kv_bytes_per_token < 0.75 * _full_bytes_per_token(model)
    draft = NgramDrafter() if drafter == "ngram" else LayerSkipDrafter(model, skip=list(range(4, 26, 3)))
    result = Engine(model, tok, draft, SpeculativeConfig(gamma=4), cache=cache).generate(
        prompt, max_new_tokens=new_tokens, eos_token_ids=())
    assert result.token_ids == plain.token_ids
    assert result.stats.accepted_tokens > 0
