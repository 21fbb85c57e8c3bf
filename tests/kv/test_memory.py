"""KVMemory: caches sized before allocation, the budget enforced with a clear error, prefix caches evicted
first, per-model prefix caches, usage figures."""

from __future__ import annotations

import pytest
import torch

from specdecode.kv.cache import CacheConfig
from specdecode.kv.memory import KVBudgetError, KVMemory, format_bytes
from tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")  # 4 layers, 2 kv heads of 16, float32: 1024 bytes per token


def _fill_prefix(memory: KVMemory, model, config: CacheConfig, tokens: int) -> None:
    tree = memory.prefix_for(model, config)
    hit = tree.match([1] * tokens)
    kv = [(torch.zeros(2, tokens, 16), torch.zeros(2, tokens, 16)) for _ in range(4)]
    tree.insert([1] * tokens, kv, hit)
    tree.release(hit)


def test_a_cache_that_fits_is_allocated_and_counted(model):
    memory = KVMemory(budget=64 * 1024)
    cache = memory.new_cache("target", model, CacheConfig(max_len=64))
    assert cache.nbytes == 64 * 1024 and memory.nbytes == cache.nbytes
    assert memory.caches == {"target": cache}
    again = memory.new_cache("target", model, CacheConfig(max_len=32))  # replaces, not adds
    assert memory.nbytes == again.nbytes == 32 * 1024


def test_a_cache_that_does_not_fit_is_refused_before_allocation_naming_the_numbers(model):
    memory = KVMemory(budget=100_000)
    memory.new_cache("target", model, CacheConfig(max_len=64))
    with pytest.raises(KVBudgetError) as info:
        memory.new_cache("draft", model, CacheConfig(max_len=64, kv_dtype="int8"))
    message = str(info.value)
    int8_bytes = model.new_cache(CacheConfig(max_len=64, kv_dtype="int8")).nbytes
    for needle in ("the draft cache for 64 tokens per sequence (int8)", f"needs {int8_bytes:,} bytes",
                   "the budget is 100,000 bytes (97.7 KiB)", "the target cache 65,536 bytes (64.0 KiB)", "--kv-budget"):
        assert needle in message, (needle, message)
    assert "draft" not in memory.caches  # nothing allocated
    assert isinstance(info.value, RuntimeError)


def test_prefix_entries_are_evicted_to_make_room_for_a_cache(model):
    config = CacheConfig(max_len=64, prefix_cache=True, prefill_chunk=8)
    memory = KVMemory(budget=100 * 1024, prefix_cache=True)
    memory.new_cache("target", model, config)
    _fill_prefix(memory, model, config, 32)
    assert memory.prefix_bytes == 32 * 1024
    memory.new_cache("draft", model, CacheConfig(max_len=32))  # 32 KiB: fits only without the prefixes
    assert memory.prefix_bytes == 0 and memory.nbytes == 96 * 1024


def test_prefix_entries_in_use_are_not_evicted(model):
    config = CacheConfig(max_len=64, prefill_chunk=8)
    memory = KVMemory(budget=100 * 1024, prefix_cache=True)
    memory.new_cache("target", model, config)
    _fill_prefix(memory, model, config, 32)
    hit = memory.prefix_for(model, config).match([1] * 32)
    with pytest.raises(KVBudgetError, match=r"plus 32,768 bytes \(32\.0 KiB\) of prefixes in use are held"):
        memory.new_cache("draft", model, CacheConfig(max_len=32))
    memory.prefix_for(model, config).release(hit)


def test_prefix_caches_grow_into_what_the_caches_leave(model):
    config = CacheConfig(max_len=64, prefill_chunk=8)
    memory = KVMemory(budget=80 * 1024, prefix_cache=True)
    memory.new_cache("target", model, config)
    _fill_prefix(memory, model, config, 40)  # 16 KiB of room: 2 blocks of 8 tokens fit
    assert memory.prefix_bytes == 16 * 1024
    assert memory.nbytes <= memory.budget


def test_one_prefix_cache_per_model_and_layout(model):
    memory = KVMemory(prefix_cache=True)
    plain, int8 = CacheConfig(), CacheConfig(kv_dtype="int8")
    tree = memory.prefix_for(model, plain)
    assert tree is memory.prefix_for(model, CacheConfig(max_len=5, budget=9)) and tree.block == plain.prefill_chunk
    assert memory.prefix_for(model, int8) is not tree
    assert memory.prefix_for(tiny_model("llama", seed=1), plain) is not tree
    assert KVMemory(prefix_cache=False).prefix_for(model, plain) is None


def test_usage_is_bytes_held_and_per_token(model):
    memory = KVMemory()
    assert memory.usage("target") == (0, 0.0)
    cache = memory.new_cache("target", model, CacheConfig(max_len=16))
    cache.advance([0], 5)
    assert memory.usage("target") == (5 * 1024, 1024.0)
    assert memory.usage("draft") == (0, 0.0)


def test_unlimited_budget_and_meta_sizing_agree_with_the_allocation(model):
    memory = KVMemory()
    for config in (CacheConfig(max_len=40), CacheConfig(max_len=40, kv_dtype="int4", group_size=8, residual=8),
                   CacheConfig(max_len=40, window=8, sinks=2)):
        cache = memory.new_cache("target", model, config)
        assert all(t.device.type == "cpu" for t in getattr(cache, "k", None) or cache.fp_k)
        assert cache.nbytes == model.new_cache(config).nbytes


@pytest.mark.parametrize("n, text", [(0, "0 bytes"), (1023, "1,023 bytes"), (1024, "1,024 bytes (1.0 KiB)"),
                                     (512 * 2 ** 20, "536,870,912 bytes (512.0 MiB)"), (3 * 2 ** 40, "(3.0 TiB)")])
def test_format_bytes(n, text):
    assert text in format_bytes(n)
