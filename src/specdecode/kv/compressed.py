"""A KV cache that quantizes (int8/int4) and/or evicts (sliding window with attention sinks) verified tokens.

Layout of one slot, by token position:

    [0, sinks)        attention sinks, full precision (only with a window)
    [sinks, e)        evicted (only with a window)
    [e, F)            the middle: int8/int4 codes, keys per channel over groups of ``group_size`` tokens,
                      values per token over the head dimension (KIVI's choice: keys have outlier channels)
    [F, length)       the tail: full precision, the most recent verified tokens and every unverified one

Only verified tokens move: ``e`` and ``F`` are step functions of ``x = min(committed, length)`` evaluated
when a layer is next written (``_targets``): with a window, ``e`` advances in chunks so that at least
``window`` verified tokens stay after it; with quantization, ``F`` advances a group at a time so that at
least ``residual`` verified tokens stay in full precision. Unverified tokens are always in the tail, so
rolling them back is lowering a length, before or after a flush and after the window wrapped; rolling
back verified tokens works as long as none of them has been compressed yet (else ``trim`` raises).

Positions: keys are cached after RoPE, so every kept key keeps its original position, and new tokens are
rotated by their true position (``lengths``), not by their index in the window. Attention therefore sees
the same relative distances as without a window, minus the evicted tokens; positions must stay within
the model's context length (the engine checks prompt + max_new_tokens against it).

Exactness under speculation: what a new token sees depends only on its position, because ``e`` and ``F``
are functions of the forward's start. A forward whose rows straddle a step would show its later rows an
older state than one-token decoding does; ``stable_rows`` tells the engine where the next step is, and
the engine drafts no further, so greedy speculation reproduces plain decoding bitwise under every setting.

``update`` returns full-precision keys/values: the middle is dequantized per layer and per forward into
a transient tensor (no persistent full-precision copy is kept). Without quantization ``update`` returns
a view of the buffer, and evicting a chunk shifts the kept tokens once per chunk (compaction, no ring).

This module does not decide what is verified (the engine commits), share prefixes (``prefix.py``) or
enforce a memory budget (``memory.py``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdecode.kv.cache import FLOAT_DTYPES, CacheConfig, CacheFullError
from specdecode.kv.quant import SCALE_DTYPE, dequantize, packed_width, quantize
from specdecode.kv.slots import SlotLengths


class CompressedCache(SlotLengths):
    """Sinks + sliding window + int8/int4 middle + full-precision tail, per slot and layer.

    Args:
        num_layers: decoder layers that store keys/values.
        kv_heads: key/value heads per layer.
        head_dim: width of one head (even for int4).
        config: sizes and compression settings (``config.compressed`` must be true).
        dtype: the model's dtype: full-precision entries are kept in it (unless ``kv_dtype`` names a float
            type) and ``update`` returns the dtype of the keys it is given.
        device: where the buffers live.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, config: CacheConfig,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if not config.compressed:
            raise ValueError(f"CompressedCache needs kv_dtype int8/int4 or a window, got kv_dtype={config.kv_dtype!r} "
                             "and no window; use KVCache")
        super().__init__(config.slots)
        self.config = config
        self.bits = config.bits
        self.window = config.window
        self.sinks = config.sinks
        self.group = config.group_size
        self.step = self.group if self.bits else config.evict_chunk  # eviction granularity
        self.fp_dtype = FLOAT_DTYPES.get(config.kv_dtype, dtype)
        self.heads, self.head_dim, self.num_layers = kv_heads, head_dim, num_layers
        if self.bits:
            tail = config.residual + self.group - 1
            span = config.max_len if self.window is None else self.window - config.residual
            self.max_groups = -(-span // self.group) if self.window is not None else span // self.group
        else:
            tail = self.window + self.step - 1
            self.max_groups = 0
        self.fp_room = self.sinks + tail + config.lookahead
        slots, h, d = config.slots, kv_heads, head_dim

        def zeros(*shape: int, dt: torch.dtype) -> list[torch.Tensor]:
            return [torch.zeros(shape, dtype=dt, device=device) for _ in range(num_layers)]

        self.fp_k = zeros(slots, h, self.fp_room, d, dt=self.fp_dtype)  # [S, H, room, D]: sinks, then the tail
        self.fp_v = zeros(slots, h, self.fp_room, d, dt=self.fp_dtype)
        if self.bits:
            width, q = packed_width(d, self.bits), self.max_groups * self.group
            self.k_codes = zeros(slots, h, q, width, dt=torch.uint8)  # middle tokens, from position e on
            self.v_codes = zeros(slots, h, q, width, dt=torch.uint8)
            self.k_scale = zeros(slots, h, self.max_groups, 1, d, dt=SCALE_DTYPE)  # per group and channel
            self.k_zero = zeros(slots, h, self.max_groups, 1, d, dt=SCALE_DTYPE)
            self.v_scale = zeros(slots, h, q, 1, dt=SCALE_DTYPE)  # per token
            self.v_zero = zeros(slots, h, q, 1, dt=SCALE_DTYPE)
        # Per layer, so that a forward over some layers (self-speculation) leaves the others as they are.
        self.evicted = [[self.sinks] * slots for _ in range(num_layers)]  # e
        self.flushed = [[self.sinks] * slots for _ in range(num_layers)]  # F

    @property
    def max_len(self) -> int:
        return self.config.max_len

    # ------------------------------------------------------------------ where compression stands

    def _targets(self, x: int) -> tuple[int, int]:
        """(e, F) once the first ``x`` tokens are verified."""
        s, c = self.sinks, self.config
        e = s if self.window is None else s + self.step * (max(0, x - s - self.window) // self.step)
        f = e if not self.bits else max(e, s + self.group * (max(0, x - s - c.residual) // self.group))
        return e, f

    def stable_rows(self, slot: int) -> int:
        p, s, c = self.lengths[slot], self.sinks, self.config
        steps = [self.max_len + 1]
        if self.window is not None:
            steps.append(s + self.window + self.step * max(1, (p - s - self.window) // self.step + 1))
        if self.bits:
            steps.append(s + c.residual + self.group * max(1, (p - s - c.residual) // self.group + 1))
        return min(steps) - p

    def direct_buffers(self, layers: Sequence[int], slots: Sequence[int], starts: Sequence[int],
                       counts: Sequence[int]) -> None:
        """None: every write goes through ``update``, which compresses and evicts (see :class:`Cache`)."""
        return None

    def visible(self, slot: int) -> int:
        p = self.lengths[slot]
        e, _ = self._targets(min(self.committed[slot], p))
        return p if p < self.sinks else self.sinks + p - e

    # ------------------------------------------------------------------ writing and reading

    def update(self, layer: int, slots: Sequence[int], starts: Sequence[int], k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends new keys/values at each slot's length and returns what its new tokens attend to.

        Args:
            layer: layer index.
            slots: the slot of each batch row.
            starts: position of each row's first new token; must be the slot's length.
            k: new keys ``[B, kv_heads, T, head_dim]``, rotated by their positions.
            v: new values, same shape.

        Returns:
            Keys and values ``[B, kv_heads, L, head_dim]`` in ``k``'s dtype: per row the sinks, the
            dequantized middle, the tail and the new tokens (the last T of ``visible(slot) + T``
            entries), shorter rows zero-padded to the longest.
        """
        views = [self._update_one(layer, s, p, k[b], v[b]) for b, (s, p) in enumerate(zip(slots, starts))]
        if len(views) == 1:
            return views[0]
        width = max(kv[0].shape[2] for kv in views)
        keys = k.new_zeros(len(views), k.shape[1], width, k.shape[3])
        values = torch.zeros_like(keys)
        for b, (kb, vb) in enumerate(views):
            keys[b, :, :kb.shape[2]] = kb[0]
            values[b, :, :vb.shape[2]] = vb[0]
        return keys, values

    def _update_one(self, layer: int, slot: int, start: int, k: torch.Tensor,
                    v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One row: ``k``/``v`` are ``[H, T, D]``; returns ``[1, H, visible + T, D]``."""
        t = k.shape[1]
        if start != self.lengths[slot]:
            raise ValueError(f"a compressed cache appends at the slot's length {self.lengths[slot]}, not at {start}")
        if start + t > self.max_len:
            raise CacheFullError(f"KV cache holds {self.max_len} tokens per sequence; a write up to {start + t} was asked")
        committed = self.committed[slot]
        self._compact(layer, slot, min(committed, start), start)
        e, f = self.evicted[layer][slot], self.flushed[layer][slot]
        index = start if start < self.sinks else self.sinks + start - f  # where the new tokens go in the buffer
        if index + t > self.fp_room:
            raise CacheFullError(
                f"compressed KV cache: writing {t} tokens at position {start} (verified up to {committed}) needs "
                f"full-precision room for {index + t - self.sinks} recent tokens, it has {self.fp_room - self.sinks} "
                f"(lookahead {self.config.lookahead}); commit verified tokens (cache.commit) or write fewer at once")
        self.fp_k[layer][slot, :, index:index + t] = k
        self.fp_v[layer][slot, :, index:index + t] = v
        end = index + t
        if f == e:  # nothing quantized: a view of the buffer
            keys = self.fp_k[layer][slot:slot + 1, :, :end]
            values = self.fp_v[layer][slot:slot + 1, :, :end]
        else:
            middle_k, middle_v = self._dequantized(layer, slot, f - e, k.dtype)
            keys = torch.cat([self.fp_k[layer][slot:slot + 1, :, :self.sinks].to(k.dtype), middle_k,
                              self.fp_k[layer][slot:slot + 1, :, self.sinks:end].to(k.dtype)], dim=2)
            values = torch.cat([self.fp_v[layer][slot:slot + 1, :, :self.sinks].to(k.dtype), middle_v,
                                self.fp_v[layer][slot:slot + 1, :, self.sinks:end].to(k.dtype)], dim=2)
        return keys.to(k.dtype), values.to(k.dtype)  # [1, H, L, D]

    def _dequantized(self, layer: int, slot: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The middle's ``n`` tokens as ``[1, H, n, D]`` keys and values (a transient tensor)."""
        h, g = self.heads, n // self.group
        codes = self.k_codes[layer][slot, :, :n].view(h, g, self.group, -1)  # [H, groups, G, D']
        keys = dequantize(codes, self.k_scale[layer][slot, :, :g], self.k_zero[layer][slot, :, :g], self.bits, dtype)
        values = dequantize(self.v_codes[layer][slot, :, :n], self.v_scale[layer][slot, :, :n],
                            self.v_zero[layer][slot, :, :n], self.bits, dtype)
        return keys.view(1, h, n, self.head_dim), values[None]

    def _compact(self, layer: int, slot: int, x: int, end: int) -> None:
        """Quantizes and evicts verified tokens until the layer matches ``_targets(x)``; ``end`` = tokens written."""
        e0, f0 = self.evicted[layer][slot], self.flushed[layer][slot]
        e1, f1 = self._targets(x)
        if (e1, f1) == (e0, f0):
            return
        if e1 < e0 or f1 < f0:
            raise RuntimeError(f"compressed cache state moved backwards at layer {layer}, slot {slot}: "
                               f"(e, F) ({e0}, {f0}) -> ({e1}, {f1})")
        s = self.sinks
        if self.bits:
            kept = max(0, f0 - e1)  # middle tokens that survive the eviction
            if kept and e1 > e0:
                self._shift_middle(layer, slot, e1 - e0, kept)
            first = max(f0, e1)  # tail tokens to quantize: [first, f1), at buffer index s + (pos - f0)
            if f1 > first:
                self._quantize_into_middle(layer, slot, s + first - f0, f1 - first, first - e1)
        # The tail keeps [f1, end), moved to the front of its room.
        n, d = max(0, end - f1), f1 - f0
        for buf in (self.fp_k[layer], self.fp_v[layer]):
            buf[slot, :, s:s + n] = buf[slot, :, s + d:s + d + n].clone()
        self.evicted[layer][slot], self.flushed[layer][slot] = e1, f1

    def _shift_middle(self, layer: int, slot: int, d: int, n: int) -> None:
        """Drops the middle's first ``d`` tokens (whole groups), keeping the ``n`` after them."""
        g, gd = n // self.group, d // self.group
        for buf in (self.k_codes, self.v_codes, self.v_scale, self.v_zero):
            buf[layer][slot, :, :n] = buf[layer][slot, :, d:d + n].clone()
        for buf in (self.k_scale, self.k_zero):
            buf[layer][slot, :, :g] = buf[layer][slot, :, gd:gd + g].clone()

    def _quantize_into_middle(self, layer: int, slot: int, index: int, n: int, at: int) -> None:
        """Quantizes ``n`` tail tokens (whole groups) from buffer ``index`` into the middle at token ``at``."""
        if (at + n) // self.group > self.max_groups:
            raise RuntimeError(f"quantized middle overflow: {at + n} tokens > {self.max_groups} groups")
        h, g, size = self.heads, n // self.group, self.group
        keys = self.fp_k[layer][slot, :, index:index + n].reshape(h, g, size, self.head_dim)
        codes, scale, zero = quantize(keys, self.bits, dim=2)  # per channel over the group's tokens
        self.k_codes[layer][slot, :, at:at + n] = codes.reshape(h, n, -1)
        self.k_scale[layer][slot, :, at // size:at // size + g] = scale
        self.k_zero[layer][slot, :, at // size:at // size + g] = zero
        codes, scale, zero = quantize(self.fp_v[layer][slot, :, index:index + n], self.bits, dim=-1)  # per token
        self.v_codes[layer][slot, :, at:at + n] = codes
        self.v_scale[layer][slot, :, at:at + n] = scale
        self.v_zero[layer][slot, :, at:at + n] = zero

    # ------------------------------------------------------------------ lengths (the rest is SlotLengths')

    def _check_uncommit(self, slot: int, length: int) -> None:
        """``trim`` rolls verified tokens back only while none of the tokens the shorter sequence would still
        hold in full precision has been quantized or evicted (unverified tokens can always be rolled back)."""
        e, f = self._targets(length)
        held_e = max(layer[slot] for layer in self.evicted)
        held_f = max(layer[slot] for layer in self.flushed)
        if e < held_e or f < held_f:
            what = "evicted" if e < held_e else "quantized"
            raise ValueError(f"cannot trim slot {slot} to {length}: tokens up to position {max(held_e, held_f)} are "
                             f"already {what}, and a sequence of {length} tokens keeps them uncompressed; only "
                             "tokens that are still in full precision can be rolled back")

    def _move_rows(self, slot: int, start: int, rows: Sequence[int]) -> None:
        """Moves unverified tokens ``start + rows[j]`` to ``start + j`` (all in full precision: unverified
        tokens are never compressed); ``compact`` checks ``rows`` and sets the length."""
        for layer in range(self.num_layers):
            # A position's index in the full-precision buffer: sinks first, then the tail from F on.
            f = self.flushed[layer][slot]
            index = [p if p < self.sinks else self.sinks + p - f for p in range(start, start + rows[-1] + 1)]
            src = torch.tensor([index[r] for r in rows], device=self.fp_k[layer].device)
            dst = torch.tensor(index[:len(rows)], device=self.fp_k[layer].device)
            for buf in (self.fp_k[layer], self.fp_v[layer]):
                buf[slot].index_copy_(1, dst, buf[slot].index_select(1, src))  # [H, n, D]

    def reset(self, slot: int) -> None:
        """Frees a slot for a new sequence, compression state included."""
        super().reset(slot)
        for layer in range(self.num_layers):
            self.evicted[layer][slot] = self.flushed[layer][slot] = self.sinks

    # ------------------------------------------------------------------ memory

    def _fp_token_bytes(self) -> int:
        """Full-precision keys + values of one token in one layer."""
        return 2 * self.heads * self.head_dim * torch.tensor([], dtype=self.fp_dtype).element_size()

    def _middle_bytes(self, tokens: int) -> float:
        """Codes + scales + zero points of ``tokens`` quantized tokens in one layer (may be fractional)."""
        h, d = self.heads, self.head_dim
        codes = 2 * h * packed_width(d, self.bits)
        scales = 2 * SCALE_DTYPE.itemsize * (h * d / self.group + h)  # keys per group and channel, values per token
        return tokens * (codes + scales)

    @property
    def bytes_per_token(self) -> float:
        """Bytes one long-held token costs across layers: quantized (scales amortized over a group) or full precision."""
        return self.num_layers * (self._middle_bytes(1) if self.bits else self._fp_token_bytes())

    @property
    def nbytes(self) -> int:
        tensors = self.fp_k + self.fp_v
        if self.bits:
            tensors += self.k_codes + self.v_codes + self.k_scale + self.k_zero + self.v_scale + self.v_zero
        return sum(t.numel() * t.element_size() for t in tensors)

    def bytes_used(self, slot: int | None = None) -> int:
        """Bytes of the tokens held: sinks and tail in full precision, the middle quantized."""
        slots = range(self.config.slots) if slot is None else [slot]
        total = 0.0
        for s in slots:
            n = self.lengths[s]
            for layer in range(self.num_layers):
                e, f = self.evicted[layer][s], self.flushed[layer][s]
                total += (min(self.sinks, n) + max(0, n - f)) * self._fp_token_bytes()
                if self.bits:
                    total += self._middle_bytes(f - e)
        return round(total)
