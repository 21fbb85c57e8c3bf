"""The KV cache interface every cache kind shares, its configuration, and the plain (uncompressed) cache.

Layout of the plain cache per layer: ``[slots, kv_heads, max_len, head_dim]``, one slot per sequence.
A forward writes the keys/values of its new tokens by index at each slot's current length and advances
that length; rolling back rejected draft tokens is lowering the length (``trim``), never a copy: stale
entries beyond a length are simply overwritten by the next write.

Every cache kind (see ``factory.make_cache``) follows one contract, :class:`Cache`:
``update`` writes a layer's new keys/values and returns full-precision keys/values in which the new
tokens of row b sit at indices ``visible(slot_b) + i``: the model lets new token i see the first
``visible + i + 1`` returned entries. ``commit`` tells the cache which tokens are verified: compressing
caches only ever quantize or evict tokens below the committed length, and ``stable_rows`` says how far a
forward may reach before the cache would present older tokens differently to some of its rows.

The per-slot length bookkeeping (``lengths``, ``committed``, ``advance``/``commit``/``trim``/``reset`` and the
checks of ``compact``) is written once, in ``slots.py``, for every cache kind.

This module does not know about models, drafting or verification, and the plain cache does not
compress, evict or share entries (see ``compressed.py`` and ``prefix.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from specdecode.kv.slots import SlotLengths

KV_DTYPES = ("auto", "bfloat16", "float32", "int8", "int4")
QUANTIZED_BITS = {"int8": 8, "int4": 4}
FLOAT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class CacheConfig:
    """How a KV cache is sized and compressed.

    Args:
        max_len: tokens one sequence may hold (prompt + generated + draft lookahead); with a window this
            bounds positions only, not memory.
        slots: sequences held at once.
        kv_dtype: element type of cached keys/values: "auto" (the model's dtype), "bfloat16", "float32",
            or "int8"/"int4" (group-wise quantization of verified tokens, see ``compressed.py``).
        window: keep (at least) the last ``window`` verified tokens plus every unverified one; None keeps all.
        sinks: with a window, the first ``sinks`` tokens are kept too (attention sinks).
        budget: bytes all KV caches and prefix caches of an engine may hold; None = unlimited.
        prefix_cache: share the K/V of verified prompt prefixes across requests (radix tree, ``prefix.py``).
        group_size: tokens per quantization group (keys are quantized per channel over a group).
        residual: int8/int4 keep at least this many recent verified tokens in full precision.
        evict_chunk: a window evicts this many tokens at a time (int8/int4 windows: one group).
        prefill_chunk: prompt tokens per prefill forward for compressing caches and with the prefix cache
            (also the prefix cache's block: prefixes are reused in whole chunks).
        lookahead: tokens a forward may write past the committed (verified) length; compressing caches
            reserve full-precision room for them. Must cover one draft step (gamma + 2) and a prefill chunk.
    """

    max_len: int = 4096
    slots: int = 1
    kv_dtype: str = "auto"
    window: int | None = None
    sinks: int = 0
    budget: int | None = None
    prefix_cache: bool = False
    group_size: int = 32
    residual: int = 32
    evict_chunk: int = 32
    prefill_chunk: int = 64
    lookahead: int = 80

    def __post_init__(self) -> None:
        for name in ("max_len", "slots", "group_size", "evict_chunk", "prefill_chunk", "lookahead"):
            if getattr(self, name) < 1:
                raise ValueError(f"CacheConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("sinks", "residual"):
            if getattr(self, name) < 0:
                raise ValueError(f"CacheConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"CacheConfig.kv_dtype={self.kv_dtype!r}: expected one of {', '.join(KV_DTYPES)}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"CacheConfig.window must be >= 1 (or None for no window), got {self.window}")
        if self.sinks and self.window is None:
            raise ValueError(f"CacheConfig.sinks={self.sinks} needs a window (sinks are what a window keeps besides "
                             "its recent tokens)")
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"CacheConfig.budget must be >= 1 byte (or None for no limit), got {self.budget}")
        if self.prefill_chunk > self.lookahead:
            raise ValueError(f"CacheConfig.prefill_chunk ({self.prefill_chunk}) must be <= lookahead "
                             f"({self.lookahead}): a prefill chunk is written before it is compressed")
        if self.bits and self.window is not None and self.window < self.residual:
            raise ValueError(f"CacheConfig.window ({self.window}) must be >= residual ({self.residual}): a "
                             f"{self.kv_dtype} cache keeps its last {self.residual} verified tokens in full precision")

    @property
    def bits(self) -> int | None:
        """Bits per quantized element (8 or 4), None when keys/values are stored as floats."""
        return QUANTIZED_BITS.get(self.kv_dtype)

    @property
    def compressed(self) -> bool:
        """True when the cache quantizes or evicts verified tokens."""
        return self.bits is not None or self.window is not None

    @property
    def layout(self) -> tuple:
        """What determines the cached numbers (not sizes or budgets): K/V computed under equal layouts are
        interchangeable, so prefix caches are keyed by it."""
        return (self.kv_dtype, self.window, self.sinks, self.group_size, self.residual, self.evict_chunk,
                self.prefill_chunk)


class CacheFullError(RuntimeError):
    """A write would run past a slot's preallocated room."""


class Cache(Protocol):
    """What the model, the engine and the drafters use of a KV cache (every kind implements it).

    ``lengths[s]`` is the number of tokens slot s holds *logically*: the position of its next token, also
    when a window has evicted some of them.
    """

    config: CacheConfig
    lengths: list[int]
    committed: list[int]

    @property
    def max_len(self) -> int: ...

    def update(self, layer: int, slots: Sequence[int], starts: Sequence[int], k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes new keys/values ``[B, kv_heads, T, head_dim]`` of the tokens at positions ``starts[b] + i``
        and returns keys/values ``[B, kv_heads, L, head_dim]`` in the dtype of ``k``, where row b's new
        token i sits at index ``visible(slots[b]) + i`` and ``L = max(visible) + T`` (shorter rows end in
        entries the caller must mask)."""

    def direct_buffers(self, layers: Sequence[int], slots: Sequence[int], starts: Sequence[int],
                       counts: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """The key and value buffers ``[slots, kv_heads, max_len, head_dim]`` (bf16) of ``layers``, where fused
        layers may write the new rows (``counts[i]`` of ``slots[i]`` at ``starts[i]``) themselves and read each
        slot's keys in place, as ``update`` would have; None where the cache must see the write (it
        compresses, evicts, records or converts). One call for all layers of a forward: it runs every step.
        Raises ``CacheFullError`` when the rows do not fit."""

    def visible(self, slot: int) -> int:
        """Entries ``update`` returns before a slot's new tokens (== its length unless tokens were evicted)."""

    def advance(self, slots: Sequence[int], n: int) -> None:
        """Marks ``n`` more tokens as held in each slot (called once per forward, after all layers)."""

    def commit(self, slot: int, length: int) -> None:
        """Declares the slot's tokens below ``length`` verified (they may be written later, as a prompt is)."""

    def trim(self, slot: int, length: int) -> None:
        """Rolls a slot back to ``length`` tokens (rejected drafts); raises when compressed tokens would be needed."""

    def reset(self, slot: int) -> None:
        """Frees a slot for a new sequence."""

    def compact(self, slot: int, start: int, rows: Sequence[int]) -> None:
        """Keeps the unverified tokens at positions ``start + rows[j]`` as ``start + j`` and drops the rest
        after ``start`` (a token tree's accepted path): the slot's length becomes ``start + len(rows)``."""

    def stable_rows(self, slot: int) -> int:
        """How many tokens a forward starting at the slot's length may write so that each of them sees
        the cache exactly as it would when decoded one token per forward (compression moves in steps)."""

    @property
    def bytes_per_token(self) -> float:
        """Bytes one long-held token costs across all layers, keys and values, scales included."""

    @property
    def nbytes(self) -> int:
        """Bytes preallocated for all slots."""

    def bytes_used(self, slot: int | None = None) -> int:
        """Bytes occupied by the tokens held, of one slot or of all."""


class KVCache(SlotLengths):
    """Static per-layer K/V buffers written by index; keeps every token in full precision.

    Lengths, commits, trimming, resetting and compaction's checks are :class:`~specdecode.kv.slots.SlotLengths`';
    rolling back is lowering a length (entries past it become stale and are overwritten by the next write).

    Args:
        num_layers: decoder layers that store keys/values.
        kv_heads: key/value heads per layer.
        head_dim: width of one head.
        config: sizes (max_len, slots).
        dtype: element type of the buffers; ``update`` returns the dtype of the keys it is given.
        device: where the buffers live.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, config: CacheConfig,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__(config.slots)
        self.config = config
        shape = (config.slots, kv_heads, config.max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def max_len(self) -> int:
        return self.config.max_len

    def update(self, layer: int, slots: Sequence[int], starts: Sequence[int], k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes new keys/values and returns everything each sequence may attend to.

        Args:
            layer: layer index.
            slots: the slot of each batch row.
            starts: position of each row's first new token (its length before this forward).
            k: new keys ``[B, kv_heads, T, head_dim]``.
            v: new values, same shape.

        Returns:
            Keys and values ``[B, kv_heads, L, head_dim]`` with ``L = max(starts) + T``; for rows
            shorter than L the tail holds stale entries that the caller must mask.
        """
        t = k.shape[2]
        end = max(starts) + t
        if end > self.max_len:
            raise CacheFullError(f"KV cache holds {self.max_len} tokens per sequence; a write up to {end} was asked")
        kb, vb = self.k[layer], self.v[layer]
        if len(slots) == 1:
            s, p = slots[0], starts[0]
            kb[s, :, p:p + t] = k[0]
            vb[s, :, p:p + t] = v[0]
            keys, values = kb[s:s + 1, :, :end], vb[s:s + 1, :, :end]
        else:
            rows = torch.tensor(slots, device=kb.device)
            pos = torch.tensor(starts, device=kb.device)[:, None] + torch.arange(t, device=kb.device)  # [B, T]
            kb[rows[:, None], :, pos] = k.transpose(1, 2)  # advanced dims first: [B, T, H, D]
            vb[rows[:, None], :, pos] = v.transpose(1, 2)
            keys, values = kb[rows, :, :end], vb[rows, :, :end]
        if keys.dtype != k.dtype:  # a cache kept in another float type than the model computes in
            keys, values = keys.to(k.dtype), values.to(k.dtype)
        return keys, values

    def direct_buffers(self, layers: Sequence[int], slots: Sequence[int], starts: Sequence[int],
                       counts: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """The layers' buffers, where they hold bf16 (the fused layers' dtype; all layers share one dtype
        and device); see :class:`Cache`."""
        if self.k[0].dtype != torch.bfloat16 or self.k[0].device.type != "cpu":
            return None
        end = max(start + n for start, n in zip(starts, counts))
        if end > self.max_len:
            raise CacheFullError(f"KV cache holds {self.max_len} tokens per sequence; a write up to {end} was asked")
        return [self.k[i] for i in layers], [self.v[i] for i in layers]

    def read(self, slot: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the slot's keys and values at positions ``[start, end)``, per layer ``[kv_heads, n, head_dim]``
        (what the prefix cache stores)."""
        return [(k[slot, :, start:end].clone(), v[slot, :, start:end].clone()) for k, v in zip(self.k, self.v)]

    def _move_rows(self, slot: int, start: int, rows: Sequence[int]) -> None:
        """Moves the kept tokens ``start + rows[j]`` to ``start + j`` in every layer (a few rows each, never the
        whole slot); ``compact`` (see :class:`~specdecode.kv.slots.SlotLengths`) checks and sets the length."""
        src = torch.tensor(rows, device=self.k[0].device) + start
        dst = torch.arange(start, start + len(rows), device=self.k[0].device)
        for buf in self.k + self.v:
            buf[slot].index_copy_(1, dst, buf[slot].index_select(1, src))  # [H, n, D]

    def stable_rows(self, slot: int) -> int:
        # Nothing is ever compressed: every row sees exactly what one-token decoding would.
        return self.max_len

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers (keys and values)."""
        per_layer = self.k[0][0, :, 0].numel() * self.k[0].element_size() if self.k else 0
        return 2 * per_layer * len(self.k)

    @property
    def nbytes(self) -> int:
        """Bytes preallocated for all slots."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def bytes_used(self, slot: int | None = None) -> int:
        """Bytes occupied by held tokens, of one slot or of all."""
        held = self.lengths[slot] if slot is not None else sum(self.lengths)
        return held * self.bytes_per_token
