"""Fills an empty cache slot with a prompt's keys/values, reusing a stored prefix when there is one.

Every token written here is verified (a prompt), so the slot is committed up front: a compressing cache
may then quantize or evict prompt tokens chunk by chunk and never needs full-precision room for the
whole prompt. The prompt is prefilled in chunks of ``prefill_chunk`` tokens at fixed positions whenever
the cache compresses or a prefix cache is used (otherwise in one forward); a prefix hit is loaded in
those same chunks through ``Cache.update``, so a slot filled from a hit holds, and later computes,
exactly what a cold prefill would. Only whole chunks are inserted into the prefix cache.

This module does not pick the model or the cache (the engine and drafters do) and never sees drafts.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Sequence

import torch

from specdecode.kv.cache import Cache
from specdecode.kv.prefix import LayerKV, PrefixCache
from specdecode.models.rows import LogitRows


class _Recorder:
    """Passes a forward through to a cache and keeps a copy of the new keys/values of each layer."""

    def __init__(self, cache: Cache) -> None:
        self.cache = cache
        self.written: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)

    def direct_buffers(self, *args: Any) -> None:
        return None  # every write must pass through update, which records it

    def update(self, layer: int, slots: Sequence[int], starts: Sequence[int], k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.written[layer].append((k[0].clone(), v[0].clone()))  # [kv_heads, T, head_dim]
        return self.cache.update(layer, slots, starts, k, v)

    def kv(self, n: int) -> LayerKV:
        """The first ``n`` recorded tokens, per layer."""
        return [(torch.cat([k for k, _ in parts], dim=1)[:, :n], torch.cat([v for _, v in parts], dim=1)[:, :n])
                for _, parts in sorted(self.written.items())]


def prefill(cache: Cache, slot: int, tokens: Sequence[int], model: Any, prefix: PrefixCache | None = None,
            features: Sequence[int] = (), observe: Callable[[int, torch.Tensor], None] | None = None,
            invariant_rows: bool = False) -> int:
    """Writes the K/V of ``tokens`` into ``slot`` (which must be empty).

    Args:
        cache: the cache to fill.
        slot: its slot for this sequence.
        tokens: verified token ids (a prompt, all but its last token).
        model: called as ``model(ids [1, T], cache, slots=(slot,), logits=LogitRows.NONE, features=...,
            invariant_rows=...)`` (a Transformer).
        prefix: the model's prefix cache, or None.
        features: layers whose features ``observe`` is handed (see ``Transformer.forward``); none when empty.
        observe: called with (first position, features ``[T, F]``) for every computed chunk; positions
            loaded from the prefix cache have no features.
        invariant_rows: compute every row as it would be alone (``Transformer.forward``), so that the
            prompt's K/V do not depend on how it was split into forwards (the batch executor prefills
            prompts a few rows at a time inside its decode steps).

    Returns:
        Tokens whose K/V came from the prefix cache.
    """
    if cache.lengths[slot]:
        raise ValueError(f"prefill needs an empty slot; slot {slot} holds {cache.lengths[slot]} tokens")
    tokens = list(tokens)
    if not tokens:
        return 0
    cache.commit(slot, len(tokens))
    chunk = cache.config.prefill_chunk if prefix is not None or cache.config.compressed else len(tokens)
    if prefix is not None and prefix.block != chunk:
        raise ValueError(f"the prefix cache's block ({prefix.block}) must be the prefill chunk ({chunk})")
    hit = prefix.match(tokens) if prefix is not None else None
    try:
        start = hit.length if hit is not None else 0
        if start:
            kv = prefix.kv(hit)
            for a in range(0, start, chunk):  # the chunks a cold prefill would have written
                for layer, (k, v) in enumerate(kv):
                    cache.update(layer, [slot], [a], k[None, :, a:a + chunk], v[None, :, a:a + chunk])
                cache.advance([slot], min(chunk, start - a))
        target = _Recorder(cache) if prefix is not None else cache
        device = getattr(model, "device", "cpu")
        for a in range(start, len(tokens), chunk):
            ids = torch.tensor([tokens[a:a + chunk]], device=device)
            if features and observe is not None:
                observe(a, model(ids, target, slots=(slot,), logits=LogitRows.NONE, features=features,
                                 invariant_rows=invariant_rows).features[0])
            else:
                model(ids, target, slots=(slot,), logits=LogitRows.NONE, invariant_rows=invariant_rows)
        whole = len(tokens) // chunk * chunk
        if prefix is not None and whole > start:
            prefix.insert(tokens[:whole], target.kv(whole - start), hit)
        return start
    finally:
        if hit is not None:
            prefix.release(hit)
