"""The target's KV cache over the engine's slots: its size per slot, its growth while the engine is idle, and what
the controllers read of it (the storage setting, the share of the KV budget in use).

Each slot holds a sequence's tokens plus one step's rows past them (the fed token and the longest draft, or
padding). Growing a slot reallocates the whole cache, so only an idle engine may. It does not assign slots
(``scheduler.py``), roll a slot back (``acceptance.py``) or prefill (``admission.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from specdecode.kv.cache import Cache, CacheConfig
from specdecode.kv.memory import KVMemory
from specdecode.kv.prefix import PrefixCache
from specdecode.models.transformer import Transformer


# Prefix blocks of prompts read inside the decode steps (any size reuses bitwise there): a conversation's next turn
# recomputes at most this many of its history's tokens, and a block costs one radix-tree node's bookkeeping.
CHUNKED_PREFIX_BLOCK = 16


def kv_setting(cache: CacheConfig, dtype: torch.dtype) -> str:
    """A target cache's storage as the controllers see it: "int8", "int4", "window" or a dtype."""
    if cache.kv_dtype in ("int8", "int4"):
        return cache.kv_dtype
    if cache.window is not None:
        return "window"
    return cache.kv_dtype if cache.kv_dtype != "auto" else str(dtype).removeprefix("torch.")


@dataclass(kw_only=True)
class TargetKV:
    """The target's cache, its settings and its prefix cache, sized by :meth:`allocate`.

    Args:
        target: the model the cache is for.
        memory: the engine's KV budget and prefix caches.
        base: the cache settings (``slots`` = the scheduler's ``max_running``; ``max_len`` is set here).
        step_rows: rows a step may write past a slot's tokens (the fed token and the longest draft or padding).
        prefix_block: tokens per reusable prefix block (None: the prefill chunk, as a prefill at admission needs).
    """

    target: Transformer
    memory: KVMemory
    base: CacheConfig
    step_rows: int
    prefix_block: int | None = None
    cache: Cache = field(init=False)
    config: CacheConfig = field(init=False)
    prefix: PrefixCache | None = field(init=False, default=None)

    def allocate(self, tokens: int) -> None:
        """Gives every slot room for ``tokens`` plus one step's rows (a fresh, empty cache)."""
        room = tokens + self.step_rows
        self.config = replace(self.base, max_len=-(-room // 64) * 64)
        self.cache = self.memory.new_cache("target", self.target, self.config)
        self.prefix = self.memory.prefix_for(self.target, self.config, self.prefix_block)

    def grow_for(self, tokens: int, busy: bool) -> None:
        """Makes the slots hold a request of ``tokens`` tokens, which only an idle engine (not ``busy``) can do.

        Raises:
            ValueError: the slots are too small while other requests are served.
        """
        if tokens + self.step_rows <= self.config.max_len:
            return
        if busy:
            raise ValueError(f"a request of {tokens} tokens does not fit the KV slots ({self.config.max_len} tokens) "
                             "while others are served; retry when the engine is idle")
        self.allocate(tokens)

    def load_prefix(self, slot: int, prompt: list[int]) -> int:
        """Writes the longest stored prefix of ``prompt`` (whole blocks) into the empty ``slot``; returns its length
        (0 without a prefix cache). For prompts prefilled inside the decode steps (``admission.py``'s chunked mode)."""
        if self.prefix is None:
            return 0
        hit = self.prefix.match(prompt)
        try:
            if hit.length:
                for layer, (k, v) in enumerate(self.prefix.kv(hit)):  # [kv_heads, hit, head_dim]
                    self.cache.update(layer, [slot], [0], k[None], v[None])
                self.cache.advance([slot], hit.length)
            return hit.length
        finally:
            self.prefix.release(hit)

    def store_prefix(self, slot: int, prompt: list[int]) -> None:
        """Stores the whole blocks of a prompt the decode steps have just finished prefilling into ``slot``. Its K/V
        are what a prefill would have computed: rows are computed alike in any forward where prompts are chunked."""
        if self.prefix is None:
            return
        whole = len(prompt) // self.prefix.block * self.prefix.block
        hit = self.prefix.match(prompt[:whole])
        try:
            if whole > hit.length:
                self.prefix.insert(prompt[:whole], self.cache.read(slot, hit.length, whole), hit)
        finally:
            self.prefix.release(hit)

    @property
    def usage(self) -> float:
        """Share of the cache's token room held by running sequences (0..1)."""
        return sum(self.cache.lengths) / (self.config.slots * self.config.max_len)

    @property
    def fill(self) -> float | None:
        """Share of the KV budget held: the target's and every drafter's cached tokens, and the prefixes."""
        if self.memory.budget is None:
            return None
        return self.memory.bytes_in_use / self.memory.budget

    def room(self, slot: int) -> int:
        """Rows a forward may write in ``slot`` now: within the slot, and not past the cache's next compression."""
        return min(self.cache.stable_rows(slot), self.config.max_len - self.cache.lengths[slot])
