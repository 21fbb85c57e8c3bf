"""Preallocated key/value cache with per-sequence lengths.

Layout per layer: ``[slots, kv_heads, max_len, head_dim]``, one slot per sequence. A forward writes
the keys/values of its new tokens by index at each slot's current length and advances that length;
rolling back rejected draft tokens is lowering the length (``trim``), never a copy: stale entries
beyond a length are simply overwritten by the next write.

This module does not know about models, drafting or verification, and it does not compress, evict
or share entries (later cache kinds build on this interface: ``update``/``trim``/``lengths``/``nbytes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class CacheConfig:
    """How a KV cache is sized.

    Args:
        max_len: tokens one sequence may hold (prompt + generated + draft lookahead).
        slots: sequences held at once.
    """

    max_len: int = 4096
    slots: int = 1

    def __post_init__(self) -> None:
        if self.max_len < 1:
            raise ValueError(f"CacheConfig.max_len must be >= 1, got {self.max_len}")
        if self.slots < 1:
            raise ValueError(f"CacheConfig.slots must be >= 1, got {self.slots}")


class CacheFullError(RuntimeError):
    """A write would run past a slot's preallocated ``max_len``."""


class KVCache:
    """Static per-layer K/V buffers written by index.

    Args:
        num_layers: decoder layers that store keys/values.
        kv_heads: key/value heads per layer.
        head_dim: width of one head.
        config: sizes (max_len, slots).
        dtype: element type of the buffers.
        device: where the buffers live.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, config: CacheConfig,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.config = config
        shape = (config.slots, kv_heads, config.max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # Python ints, so that reading a length never synchronises with a device.
        self.lengths = [0] * config.slots

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
            return kb[s:s + 1, :, :end], vb[s:s + 1, :, :end]
        rows = torch.tensor(slots, device=kb.device)
        pos = torch.tensor(starts, device=kb.device)[:, None] + torch.arange(t, device=kb.device)  # [B, T]
        kb[rows[:, None], :, pos] = k.transpose(1, 2)  # advanced dims first: [B, T, H, D]
        vb[rows[:, None], :, pos] = v.transpose(1, 2)
        return kb[rows, :, :end], vb[rows, :, :end]

    def advance(self, slots: Sequence[int], n: int) -> None:
        """Marks ``n`` more tokens as held in each slot (called once per forward, after all layers)."""
        for s in slots:
            self.lengths[s] += n

    def trim(self, slot: int, length: int) -> None:
        """Rolls a slot back to ``length`` tokens; entries past it become stale and are overwritten later.

        Args:
            slot: the sequence.
            length: new length, at most the current one.
        """
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot trim slot {slot} of length {self.lengths[slot]} to {length}")
        self.lengths[slot] = length

    def reset(self, slot: int) -> None:
        """Frees a slot for a new sequence."""
        self.lengths[slot] = 0

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
