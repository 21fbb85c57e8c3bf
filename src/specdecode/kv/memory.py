"""One byte budget over an engine's KV caches (target, draft) and its prefix caches.

A cache is sized before it is allocated (built on the "meta" device, so the figure is the allocation's
own), and refused with :class:`KVBudgetError`, naming the numbers, when it cannot fit even after every
unreferenced prefix entry has been evicted: a request that does not fit fails before any buffer is
allocated, never with an out-of-memory crash. Prefix caches grow into whatever the caches leave of the budget, or,
with no budget, up to the caches' own size; least recently used entries go first.

Not counted: transient tensors of a forward (activations, dequantized views), which do not outlive it.
This module does not decide what a cache holds (see ``compressed.py``) or what a prefix is (``prefix.py``).
"""

from __future__ import annotations

from typing import Any

from specdecode.kv.cache import Cache, CacheConfig
from specdecode.kv.factory import make_cache
from specdecode.kv.prefix import PrefixCache


class KVBudgetError(RuntimeError):
    """A KV cache does not fit the configured byte budget."""


def format_bytes(n: float) -> str:
    """``1234567`` -> ``"1,234,567 bytes (1.2 MiB)"``."""
    size, unit = float(n), "bytes"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{int(n):,} bytes" + ("" if unit == "bytes" else f" ({size:.1f} {unit})")


class KVMemory:
    """The KV memory of one engine: named per-request caches and per-model prefix caches, under one budget.

    Args:
        budget: bytes everything may hold; None = unlimited.
        prefix_cache: keep prefix caches (``prefix_for`` returns None otherwise).
    """

    def __init__(self, budget: int | None = None, prefix_cache: bool = False) -> None:
        self.budget = budget
        self.prefix_cache = prefix_cache
        self.caches: dict[str, Cache] = {}
        self.prefixes: dict[tuple, PrefixCache] = {}

    def new_cache(self, name: str, model: Any, config: CacheConfig) -> Cache:
        """Allocates (or replaces) the cache called ``name`` for ``model``, after checking that it fits.

        Args:
            name: "target" or "draft".
            model: a :class:`~specdecode.models.transformer.Transformer` (its geometry, dtype and device).
            config: the cache's sizes and compression.

        Raises:
            KVBudgetError: the cache does not fit next to the other caches, even with no prefix entries.
        """
        c = model.config
        geometry = (c.num_layers, c.num_kv_heads, c.head_dim)
        planned = make_cache(*geometry, config, dtype=model.dtype, device="meta").nbytes
        self._make_room(name, planned, config)
        self.caches.pop(name, None)
        cache = make_cache(*geometry, config, dtype=model.dtype, device=model.device)
        self.caches[name] = cache
        return cache

    def _make_room(self, name: str, planned: int, config: CacheConfig) -> None:
        if self.budget is None:
            return
        others = {n: c.nbytes for n, c in self.caches.items() if n != name}
        over = planned + sum(others.values()) + self.prefix_bytes - self.budget
        for tree in self.prefixes.values():
            if over > 0:
                over -= tree.evict(over)
        if over > 0:
            held = ", ".join(f"the {n} cache {format_bytes(b)}" for n, b in others.items()) or "no other cache"
            window = f", window {config.window} + {config.sinks} sinks" if config.window is not None else ""
            raise KVBudgetError(
                f"KV budget exceeded: the {name} cache for {config.max_len} tokens per sequence ({config.kv_dtype}"
                f"{window}) needs {format_bytes(planned)}, but the budget is {format_bytes(self.budget)} and "
                f"{held} plus {format_bytes(self.prefix_bytes)} of prefixes in use are held; raise --kv-budget, ask "
                "for fewer tokens, or compress more (--kv-dtype int8/int4, --kv-window)")

    def prefix_for(self, model: Any, config: CacheConfig, block: int | None = None) -> PrefixCache | None:
        """The prefix cache of ``model`` under ``config``'s layout, reused in whole ``block``s (default: the prefill
        chunk, which a prefill at admission needs; prompts read inside the decode steps may use any); None when
        prefix caching is off."""
        if not self.prefix_cache:
            return None
        key = (model, config.layout, block or config.prefill_chunk)
        if key not in self.prefixes:
            tree = PrefixCache(block or config.prefill_chunk)
            tree.room = lambda tree=tree: self._prefix_room(tree)
            self.prefixes[key] = tree
        return self.prefixes[key]

    def _prefix_room(self, tree: PrefixCache) -> int | None:
        """Bytes ``tree`` may hold: the budget less the caches and the other prefix caches; with no budget, as many
        bytes as the caches are allocated (prefixes at most double the KV memory; no limit before any cache is)."""
        if self.budget is None and not self.caches:
            return None
        others = sum(t.nbytes for t in self.prefixes.values() if t is not tree)
        caches = sum(c.nbytes for c in self.caches.values())
        limit = caches if self.budget is None else self.budget - caches
        return max(0, limit - others)

    @property
    def prefix_bytes(self) -> int:
        return sum(t.nbytes for t in self.prefixes.values())

    @property
    def prefix_evicted_tokens(self) -> int:
        """Tokens the prefix caches have dropped to make room."""
        return sum(t.evicted_tokens for t in self.prefixes.values())

    @property
    def bytes_in_use(self) -> int:
        """Bytes the caches' held tokens and the prefix caches take (what presses on the budget)."""
        return sum(c.bytes_used() for c in self.caches.values()) + self.prefix_bytes

    @property
    def nbytes(self) -> int:
        """Bytes held: caches (as allocated) and prefix caches."""
        return sum(c.nbytes for c in self.caches.values()) + self.prefix_bytes

    def usage(self, name: str, slot: int = 0) -> tuple[int, float]:
        """(bytes the named cache's slot holds, bytes per token of that slot); (0, 0.0) for no such cache."""
        cache = self.caches.get(name)
        if cache is None or not cache.lengths[slot]:
            return 0, 0.0
        used = cache.bytes_used(slot)
        return used, used / cache.lengths[slot]
