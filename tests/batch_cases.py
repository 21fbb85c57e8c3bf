"""Requests and cache settings the greedy batch tests share: prompts of different shapes and budgets of
different lengths (so sequences finish and slots are reused mid-run), and every cache configuration."""

from __future__ import annotations

from specdecode.kv.cache import CacheConfig

PROMPTS = [
    [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8],  # repetitive: n-gram lookup proposes from the start
    [90, 3, 17, 44, 2, 60, 5, 71, 33, 12, 19, 64],
    [5],
    [11, 12, 13, 14, 11, 12, 13, 14, 11, 12],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60],
    [3, 3, 3, 3, 3, 3],
    [70, 20, 70, 21, 70, 22, 70],
]
BUDGETS = [30, 7, 25, 40, 12, 33, 18]
CACHE_SETTINGS = {
    "auto": CacheConfig(),
    "int8": CacheConfig(kv_dtype="int8", group_size=4, residual=4, prefill_chunk=8),
    "int4-window": CacheConfig(kv_dtype="int4", window=12, sinks=2, group_size=2, residual=4, prefill_chunk=8),
    "window": CacheConfig(window=6, sinks=2, evict_chunk=3, prefill_chunk=8),
    "prefix": CacheConfig(prefix_cache=True, prefill_chunk=4),
}


def requests() -> list[dict]:
    """Greedy requests over PROMPTS with BUDGETS, no end-of-sequence token (each runs to its budget)."""
    return [dict(prompt=p, max_new_tokens=n, eos_token_ids=()) for p, n in zip(PROMPTS, BUDGETS)]
