"""prefill(): a prefix-cache hit fills a slot exactly as a cold prefill does, for every cache kind; only whole
chunks of verified prompt tokens are stored; references are released."""

from __future__ import annotations

import pytest
import torch

from specdecode.kv.cache import CacheConfig
from specdecode.kv.memory import KVMemory
from specdecode.models.build import from_hf_tensors
from specdecode.models.prefill import prefill
from specdecode.kv.prefix import PrefixCache
from tiny_models import random_hf_tensors, tiny_config
from specdecode.models.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNK = 8
SETTINGS = {
    "plain": CacheConfig(max_len=96, prefill_chunk=CHUNK),
    "bfloat16": CacheConfig(max_len=96, kv_dtype="bfloat16", prefill_chunk=CHUNK),
    "int8": CacheConfig(max_len=96, kv_dtype="int8", group_size=4, residual=4, prefill_chunk=CHUNK),
    "int4-window": CacheConfig(max_len=96, kv_dtype="int4", window=12, sinks=2, group_size=4, residual=4,
                               prefill_chunk=CHUNK),
    "window": CacheConfig(max_len=96, window=10, sinks=1, evict_chunk=3, prefill_chunk=CHUNK),
}
SHARED = [(11 * i + 5) % 97 for i in range(21)]
FIRST = SHARED + [3, 1, 4, 1, 5, 9, 2, 6, 5]  # 30 tokens
SECOND = SHARED + [8, 8, 8, 8, 40, 41, 42, 43, 44, 45, 46, 47, 48]  # 34 tokens: 21 shared -> a 16-token hit


@pytest.fixture(scope="module")
def model() -> Transformer:
    config = tiny_config("llama")
    return from_hf_tensors(config, random_hf_tensors(config, 0, scale=0.2))


def _continue(model, cache, last: int, steps: int = 12) -> list[torch.Tensor]:
    """Greedy decoding the way the engine verifies: the fed token plus a filler row, invariant rows."""
    out, token = [], last
    for _ in range(steps):
        held = cache.lengths[0]
        logits = model(torch.tensor([[token, token]]), cache, invariant_rows=True).logits[0, 0]
        cache.trim(0, held + 1)
        cache.commit(0, held + 1)
        out.append(logits)
        token = int(logits.argmax())
    return out


def _run(model, config: CacheConfig, memory: KVMemory, prompt: list[int]) -> tuple[int, list[torch.Tensor]]:
    cache = model.new_cache(config)
    hit = prefill(cache, 0, prompt[:-1], model, memory.prefix_for(model, config))
    return hit, _continue(model, cache, prompt[-1])


@pytest.mark.parametrize("name", SETTINGS)
def test_a_prefix_hit_reproduces_a_cold_cache_bitwise(model, name):
    config = SETTINGS[name]
    warm = KVMemory(prefix_cache=True)
    assert _run(model, config, warm, FIRST)[0] == 0
    tree = warm.prefix_for(model, config)
    assert tree.tokens == 24  # 29 prefilled tokens: three whole chunks stored
    hit, got = _run(model, config, warm, SECOND)
    assert hit == 16
    cold_hit, want = _run(model, config, KVMemory(prefix_cache=True), SECOND)
    assert cold_hit == 0
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert tree.referenced == 0
    assert tree.tokens == 24 + 11  # SECOND's 32 whole-chunk tokens share 21 with FIRST's: 11 new ones
    # The same prompt again is a hit of all its whole chunks.
    hit, again = _run(model, config, warm, SECOND)
    assert hit == 32 and all(torch.equal(a, b) for a, b in zip(again, want))


def test_a_hit_that_covers_the_whole_prefill_needs_no_forward(model):
    config = SETTINGS["int8"]
    memory = KVMemory(prefix_cache=True)
    prompt = SHARED[:17]  # 16 prefilled tokens: two whole chunks
    _run(model, config, memory, prompt)
    calls = []

    def counting(*args, **kwargs):
        calls.append(args)
        return model(*args, **kwargs)

    counting.device = model.device
    cache = model.new_cache(config)
    assert prefill(cache, 0, prompt[:-1], counting, memory.prefix_for(model, config)) == 16
    assert calls == [] and cache.lengths == [16] and cache.committed == [16]
    fresh = model.new_cache(config)
    prefill(fresh, 0, prompt[:-1], model)
    assert all(torch.equal(a, b) for a, b in zip(_continue(model, cache, prompt[-1]),
                                                   _continue(model, fresh, prompt[-1])))


def test_without_a_prefix_cache_a_plain_cache_prefills_in_one_forward(model):
    calls = []

    def counting(ids, cache, **kwargs):
        calls.append(ids.shape[1])
        return model(ids, cache, **kwargs)

    counting.device = model.device
    assert prefill(model.new_cache(CacheConfig(max_len=64)), 0, FIRST, counting) == 0
    assert calls == [30]
    calls.clear()
    prefill(model.new_cache(SETTINGS["window"]), 0, FIRST, counting)
    assert calls == [8, 8, 8, 6]  # a compressing cache: chunks, so it never needs room for the whole prompt
    cache = model.new_cache(SETTINGS["window"])
    assert prefill(cache, 0, [], model) == 0 and cache.lengths == [0]


def test_prefill_refuses_a_busy_slot_and_a_mismatched_block(model):
    cache = model.new_cache(SETTINGS["plain"])
    cache.advance([0], 3)
    with pytest.raises(ValueError, match="needs an empty slot; slot 0 holds 3 tokens"):
        prefill(cache, 0, FIRST, model)
    with pytest.raises(ValueError, match=r"block \(4\) must be the prefill chunk \(8\)"):
        prefill(model.new_cache(SETTINGS["plain"]), 0, FIRST, model, PrefixCache(block=4))
