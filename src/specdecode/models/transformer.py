"""A Llama/Qwen2/Mistral-family decoder that runs over a KV cache (:class:`~specdecode.kv.cache.Cache`).

One forward takes any number of new tokens per sequence (prefill, one decode step, or a draft to
verify), writes their keys/values into the cache by index and can run a subset of its layers
(self-speculation). Projections are fused (q/k/v in one matmul, gate/up in another) because on a
CPU the per-call overhead of small matmuls dominates small models.

On our kernels (``pack_weights``) each layer of a row-invariant forward runs as one fused C++ call
(``kernels/layer.h``): RMSNorm, projections (bf16 or block-quantized weights), RoPE, the cache write,
attention and the MLP, with an fp32 residual stream; the modules' own ops remain for the other paths.

It does not load files (see ``loader.py``), sample, or decide what to keep in the cache: callers
trim the cache after a forward when draft tokens are rejected.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache
from typing import Any, Callable, Literal, Mapping, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdecode import tree
from specdecode.kv.cache import Cache, CacheConfig
from specdecode.kv.factory import make_cache
from specdecode.models.config import ModelConfig, expected_tensor_shapes
from specdecode.models import native
from specdecode.models.linear import (LINEAR_KERNELS, NATIVE_KERNELS, Int8Linear, NativeLinear, PackedLinear, QuantLinear,
                                      can_pack, packed_linear)
from specdecode.models.weights import (BLOCK_FORMATS, WEIGHT_FORMATS, WeightSource, as_format, choose_format, concat,
                                       quantize)

Logits = Literal["all", "last", "none"]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` with the config's RoPE scaling applied."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv.float()
    if kind == "linear":
        return (inv / scaling["factor"]).float()
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old_ctx / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled).float()
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def rope_tables(inv_freq: torch.Tensor, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` ``[n, D]`` for positions 0..n-1 (on ``inv_freq``'s device), as ``apply_rope`` takes them."""
    angles = torch.outer(torch.arange(n, dtype=torch.float32, device=inv_freq.device), inv_freq)
    sin = angles.sin()
    # Halves of one frequency: the sine's first half is negated for apply_rope's roll.
    return torch.cat((angles, angles), dim=-1).cos().to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def rope_rows(inv_freq: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos``, ``sin`` ``[n, D/2]`` of positions 0..n-1, one frequency per pair of halves: the fused
    layers' tables (angles computed in float64)."""
    angles = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq.double().cpu())
    return angles.cos().float().contiguous(), angles.sin().float().contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x [B, T, H, D]`` by angles given as ``cos``/``sin [B, T, 1, D]`` (rotate-half layout).

    ``sin`` comes with its first half negated (see ``Transformer._rope``), so the rotation is one roll:
    ``x * cos + roll(x, D/2) * sin`` equals ``x * cos + cat(-x2, x1) * sin`` bitwise.
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      hidden: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the T newest tokens over the given keys, as two batched matmuls per call.

    The query heads sharing a key head are stacked as rows of one matmul, so no key is repeated. Scores
    are computed in the model dtype and the softmax in float32, like transformers' eager attention.
    Whether a row's result depends on how many rows share the call is up to the matmul library (on one
    Intel CPU it did for bf16 at 717 keys): ``rowwise_attention`` calls it one new token at a time.

    Args:
        q: ``[B, H, T, D]``, the queries of the last T positions of ``keys``.
        keys: ``[B, Hkv, L, D]`` (H a multiple of Hkv: query heads h*G..h*G+G-1 share key head h).
        values: ``[B, Hkv, L, D]``.
        hidden: ``[G*T, L]`` bool, True where a key is not visible to a query row (rows ordered
            group member-major, then position), or None when every key is visible.

    Returns:
        ``[B, H, T, D]``.
    """
    b, h, t, d = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(b, kv_heads, (h // kv_heads) * t, d)  # [B, Hkv, G*T, D]
    scores = (torch.matmul(grouped, keys.transpose(-1, -2)) * d ** -0.5).float()  # [B, Hkv, G*T, L]
    if hidden is not None:
        scores.masked_fill_(hidden, float("-inf"))  # in place on the float copy: one tensor less per layer
    probs = scores.softmax(-1).to(values.dtype)
    return torch.matmul(probs, values).view(b, h, t, d)


def rowwise_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      window: int | None = None) -> torch.Tensor:
    """Attention of the T newest tokens, each over exactly its own keys by one ``grouped_attention`` call.

    Each call is the one a one-token decode step at that position makes, so every row is bitwise what
    decoding computes, on any device and library: row-invariant by construction, at T calls per layer.

    Args:
        q: ``[B, H, T, D]``, the queries of the last T positions of ``keys``.
        keys: ``[B, Hkv, L, D]``.
        values: ``[B, Hkv, L, D]``.
        window: each token sees at most its last ``window`` keys (Mistral's sliding window), or None.

    Returns:
        ``[B, H, T, D]``.
    """
    t, length = q.shape[2], keys.shape[2]
    rows = []
    for i in range(t):
        end = length - t + i + 1
        start = 0 if window is None else max(0, end - window)
        rows.append(grouped_attention(q[:, :, i:i + 1], keys[:, :, start:end], values[:, :, start:end]))
    return rows[0] if t == 1 else torch.cat(rows, dim=2)


def indexed_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor,
                      counts: torch.Tensor) -> torch.Tensor:
    """Attention of each new token over its own list of keys (a token tree), one ``grouped_attention`` call
    per token: a token whose keys form one range gets the call ``rowwise_attention`` makes for it.

    Args:
        q: ``[1, H, T, D]``.
        keys: ``[1, Hkv, L, D]``.
        values: ``[1, Hkv, L, D]``.
        index: ``[T, M]`` key indices per token (see ``tree.key_index``); ``counts [T]`` how many are used.

    Returns:
        ``[1, H, T, D]``.
    """
    rows = []
    for i, (idx, n) in enumerate(zip(index.tolist(), counts.tolist())):
        idx = idx[:n]
        if idx[-1] - idx[0] + 1 == n:  # one range, as decoding sees it
            k, v = keys[:, :, idx[0]:idx[-1] + 1], values[:, :, idx[0]:idx[-1] + 1]
        else:
            pick = torch.tensor(idx, device=keys.device)
            k, v = keys.index_select(2, pick), values.index_select(2, pick)
        rows.append(grouped_attention(q[:, :, i:i + 1], k, v))
    return torch.cat(rows, dim=2)


@lru_cache(maxsize=8)  # every layer of a forward asks for the same mask
def causal_hidden(t: int, length: int, group: int, device: torch.device | None = None) -> torch.Tensor | None:
    """Mask for ``grouped_attention``: new token i (of T, the last T of L keys) sees keys 0..L-T+i.

    Args:
        t: new tokens.
        length: keys L, the new ones included.
        group: query heads per key head (rows are repeated per group member).
        device: where the mask lives.
    """
    if t == 1:
        return None
    key_pos = torch.arange(length, device=device)
    query_pos = torch.arange(length - t, length, device=device)[:, None]  # [T, 1]
    return (key_pos > query_pos).repeat(group, 1)  # [G*T, L]


def linear_kernel_problem(kernel: str, dtype: torch.dtype, device: torch.device,
                          log: Callable[[str], None] | None = None) -> str | None:
    """Why ``kernel`` cannot run the projections of a ``dtype`` model on ``device`` here, or None.

    Args:
        kernel: one of LINEAR_KERNELS.
        dtype: the model's parameter dtype.
        device: where the model lives.
        log: told about a first compile of one of our kernels (asking builds it).
    """
    if kernel not in LINEAR_KERNELS:
        return f"linear kernel {kernel!r} is not one of {', '.join(LINEAR_KERNELS)}"
    if kernel in ("auto", "torch"):
        return None
    if dtype != torch.bfloat16 or device.type != "cpu":
        return f"the {kernel} kernel needs a bf16 model on the CPU (this one is {dtype} on {device})"
    if kernel in NATIVE_KERNELS:
        reason = native.unavailable_reason(kernel, log)
        return None if reason is None else f"the {kernel} kernel is unavailable: {reason}"
    return None if can_pack(torch.empty(0, dtype=dtype)) else "oneDNN cannot pack bf16 weights for this CPU or torch build"


LINEAR_ENV = "SPECDECODE_LINEAR"  # forces a path wherever "auto" is asked for (tests, CI, the CLI)


def resolve_linear_kernel(kernel: str, dtype: torch.dtype, device: torch.device,
                          log: Callable[[str], None] | None = None) -> str:
    """The kernel a model's projections will run on: ``kernel`` itself, or for "auto" the path in
    ``$SPECDECODE_LINEAR`` if set, else the first of tiled, avx512, avx2 (ours, ``models/native.py``),
    oneDNN and torch (``F.linear``) that can run here.

    Raises:
        ValueError: ``kernel`` is unknown or cannot run here; the message says why.
    """
    forced = os.environ.get(LINEAR_ENV, "auto").strip() or "auto"
    if kernel == "auto" and forced != "auto":
        problem = linear_kernel_problem(forced, dtype, device, log)
        if problem is not None:
            raise ValueError(f"{LINEAR_ENV}={forced}: {problem}")
        return forced
    if kernel != "auto":
        problem = linear_kernel_problem(kernel, dtype, device, log)
        if problem is not None:
            raise ValueError(problem)
        return kernel
    return next((k for k in (*NATIVE_KERNELS, "onednn") if linear_kernel_problem(k, dtype, device, log) is None), "torch")


def attention_ops(kernel: str, log: Callable[[str], None] | None = None):
    """Our compiled attention for a model whose projections run on ``kernel`` (the same build's), or None
    off our paths (``Block.attend`` then uses ``rowwise_attention``)."""
    if kernel not in NATIVE_KERNELS:
        return None
    return native.kernel(kernel, log)


def projection_parts(layer: int) -> dict[str, list[str]]:
    """Each fused projection of layer ``layer`` and the checkpoint tensors (HF names, without ``.weight``)
    stacked into it, in order."""
    p = f"model.layers.{layer}."
    return {"wqkv": [f"{p}self_attn.{n}_proj" for n in "qkv"], "wo": [f"{p}self_attn.o_proj"],
            "w_gate_up": [f"{p}mlp.gate_proj", f"{p}mlp.up_proj"], "w_down": [f"{p}mlp.down_proj"]}


def head_part(config: ModelConfig) -> str:
    """The checkpoint tensor the output head computes with (the embedding table when tied)."""
    return "model.embed_tokens" if config.tie_word_embeddings else "lm_head"


class _HeadView(NamedTuple):
    """A tied output head seen as a bias-free linear layer over the embedding table."""

    weight: torch.Tensor
    bias: None = None


class Block(nn.Module):
    """One pre-norm decoder layer: attention with GQA, then a SwiGLU MLP."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.eps = c.rms_norm_eps
        self.window = c.sliding_window
        self.attn_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.wqkv = nn.Linear(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=c.attention_bias)
        self.wo = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.w_gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.w_down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.attention_ops = None  # our compiled attention (``native``), set by Transformer.pack_weights
        self.fused = None  # the whole layer as one kernel call (``native`` Layer), set by fuse()
        self.fused_ops = None

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Row-invariant attention of the T newest tokens (``[B, H, T, D]``) over the keys (``[B, Hkv, L, D]``):
        our kernel where it was compiled for this model, else ``rowwise_attention``."""
        if self.attention_ops is not None:  # set only on bf16 CPU models (our paths)
            return self.attention_ops.attention(q, keys, values, self.window or 0, self.head_dim ** -0.5)
        return rowwise_attention(q, keys, values, self.window)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[B, H, T, D]``, keys and values ``[B, Hkv, T, D]`` of ``x [B, T, hidden]``, RoPE applied."""
        b, t, _ = x.shape
        h = F.rms_norm(x, (x.shape[-1],), self.attn_norm, self.eps)
        qkv = self.wqkv(h).view(b, t, self.heads + 2 * self.kv_heads, self.head_dim)  # [B, T, H + 2 Hkv, D]
        qk = apply_rope(qkv[:, :, :self.heads + self.kv_heads], cos, sin)  # queries and keys in one go
        q = qk[:, :, :self.heads].transpose(1, 2)  # [B, H, T, D]
        k = qk[:, :, self.heads:].transpose(1, 2)  # [B, Hkv, T, D]
        return q, k, qkv[:, :, self.heads + self.kv_heads:].transpose(1, 2)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream after the output projection of ``attn [B, H, T, D]`` and the MLP."""
        b, t, _ = x.shape
        x = x + self.wo(attn.transpose(1, 2).reshape(b, t, -1))
        h = F.rms_norm(x, (x.shape[-1],), self.mlp_norm, self.eps)
        gate, up = self.w_gate_up(h).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)

    def forward(self, x: torch.Tensor, layer: int, cache: Cache, slots: Sequence[int], starts: Sequence[int],
                cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The fused path: all rows of ``x [B, T, hidden]`` attend in one call under ``mask``."""
        q, k, v = self.qkv(x, cos, sin)
        keys, values = cache.update(layer, slots, starts, k, v)  # [B, Hkv, L, D]
        if mask is None:
            attn = self.attend(q, keys, values)  # [B, H, T, D]
        else:
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                  enable_gqa=self.heads != self.kv_heads)
        return self.finish(x, attn)

    def attend_indexed(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor,
                       counts: torch.Tensor) -> torch.Tensor:
        """Row-invariant attention of one sequence's T new tokens (``[1, H, T, D]``), token t over the keys
        ``index[t, :counts[t]]`` (a token tree, ``tree.key_index``): our kernel, else ``indexed_attention``."""
        if self.attention_ops is not None:
            return self.attention_ops.attention_indexed(q, keys, values, index, counts, self.head_dim ** -0.5)
        return indexed_attention(q, keys, values, index, counts)

    def forward_rows(self, x: torch.Tensor, layer: int, cache: Cache, slots: Sequence[int], starts: Sequence[int],
                     counts: Sequence[int], cos: torch.Tensor, sin: torch.Tensor,
                     trees: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> torch.Tensor:
        """The row-invariant path: ``x [1, N, hidden]`` holds ``counts[i]`` consecutive rows of the sequence in
        ``slots[i]``; each sequence's rows attend over its own cache alone (``attend``), or, where ``trees[i]``
        gives a key index and counts (``tree.key_index``), each row over its context and ancestors, so a row's
        result does not depend on what else shares the forward."""
        q, k, v = self.qkv(x, cos, sin)  # q [1, H, N, D], k/v [1, Hkv, N, D]
        parts, offset = [], 0
        for slot, start, n, seen in zip(slots, starts, counts, trees or [None] * len(slots)):
            rows = slice(offset, offset + n)
            keys, values = cache.update(layer, (slot,), (start,), k[:, :, rows], v[:, :, rows])  # [1, Hkv, L, D]
            if seen is None:
                parts.append(self.attend(q[:, :, rows], keys, values))
            else:
                parts.append(self.attend_indexed(q[:, :, rows], keys, values, *seen))
            offset += n
        return self.finish(x, parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))

    def fuse(self, ops) -> None:
        """Runs this layer as one kernel call (``forward_fused``) with ``ops``, our kernels of its projections'
        path; its projections must be packed for them (``NativeLinear`` or ``QuantLinear``)."""
        self.fused_ops = ops
        self.fused = ops.Layer(self.wqkv.proj(), self.wo.proj(), self.w_gate_up.proj(), self.w_down.proj(),
                               self.attn_norm, self.mlp_norm, self.eps, self.heads, self.kv_heads, self.head_dim)

    def forward_fused(self, x: torch.Tensor, layer: int, cache: Cache, slots: Sequence[int], starts: Sequence[int],
                      counts: Sequence[int], rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                      trees: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> torch.Tensor:
        """``forward_rows`` as one kernel call per layer: ``x [N, hidden]`` fp32 -> fp32; ``rope`` is the fp32
        tables ``cos``/``sin [P, D/2]`` and the rows' positions ``[N]``. A plain cache's buffers are written
        in the kernel; other caches take the new keys/values through ``update`` (same numbers either way)."""
        ops, window = self.fused_ops, self.window or 0
        buffers = cache.direct_buffers((layer,), slots, starts, counts)
        if buffers is not None:
            return ops.layer_rows(self.fused, x, *rope, buffers[0][0], buffers[1][0], list(slots), list(starts),
                                  list(counts), window, [None if seen is None else list(seen) for seen in trees])
        q, k, v = ops.layer_qkv(self.fused, x, *rope)  # q [N, H, D] fp32, k/v [1, Hkv, N, D] bf16
        attn = x.new_empty(x.shape[0], self.heads * self.head_dim)
        offset = 0
        for slot, start, n, seen in zip(slots, starts, counts, trees):
            keys, values = cache.update(layer, (slot,), (start,), k[:, :, offset:offset + n], v[:, :, offset:offset + n])
            ops.layer_attend(self.fused, q, offset, n, keys, values, window, *(seen or (None, None)), attn)
            offset += n
        return ops.layer_finish(self.fused, x, attn)


class Transformer(nn.Module):
    """Decoder-only transformer with fused projections.

    Args:
        config: the architecture.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Set by pack_weights() / quantize_weights(); a tied head then gets its own copy.
        self.head_layer: NativeLinear | QuantLinear | PackedLinear | Int8Linear | None = None
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self._rope_cache: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self._rope_fp32: tuple[torch.Tensor, torch.Tensor] | None = None  # the fused layers' cos/sin [P, D/2]
        self.fused_head = None  # the output head as a fused-kernel projection (pack_weights), with its kernels:
        self.fused_ops = None
        self._fused_layers: list[Any] = []  # each layer's fused kernel object (``native`` Layer), in order
        self._packed_as = "bf16"  # the weights pack_weights was asked for

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, config: CacheConfig) -> Cache:
        """A KV cache of the kind ``config`` asks for, shaped for this model, in its dtype and on its device."""
        c = self.config
        return make_cache(c.num_layers, c.num_kv_heads, c.head_dim, config, dtype=self.dtype, device=self.device)

    def _rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Tables grow by doubling so that a long generation rebuilds them O(log n) times.
        if self._rope_cache is None or self._rope_cache[0] < length:
            n = max(length, 2 * self._rope_cache[0] if self._rope_cache else 256)
            self._rope_cache = (n, *rope_tables(self.inv_freq, n, self.dtype))
        return self._rope_cache[1], self._rope_cache[2]

    def _rope_rows(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``cos``, ``sin`` ``[>= length, D/2]`` for the fused layers (one frequency per pair of halves)."""
        if self._rope_fp32 is None or self._rope_fp32[0].shape[0] < length:
            self._rope_fp32 = rope_rows(self.inv_freq, max(length, 2 * self._rope_fp32[0].shape[0]
                                                           if self._rope_fp32 else 256))
        return self._rope_fp32

    @property
    def fused(self) -> bool:
        """Whether row-invariant forwards run each layer as one kernel call (our kernels; ``pack_weights``)."""
        return self.fused_head is not None

    def forward(self, tokens: torch.Tensor, cache: Cache, slots: Sequence[int] = (0,),
                layers: Sequence[int] | None = None, logits: Logits = "all",
                invariant_rows: bool = False, features: Sequence[int] = ()):
        """Runs new tokens through the model, appending their keys/values to the cache.

        Args:
            tokens: ``[B, T]`` new token ids, row b continuing the sequence in ``slots[b]``.
            cache: the KV cache; each slot's length advances by T.
            slots: cache slot of each row.
            layers: indices of the layers to run (self-speculation); None runs all of them.
            logits: "all" positions ``[B, T, V]``, "last" position ``[B, 1, V]``, or "none" (prefill).
            invariant_rows: compute each row so that it is bitwise independent of how many new tokens
                share the call (:meth:`forward_rows`); the fused attention's summation order is not.
                With projections on our kernels (row-invariant too) this makes greedy verification
                reproduce decoding exactly.
            features: layers whose outputs to return for every new token (drafters built on the target's
                features, e.g. ``drafters/eagle.py``): i < num_layers is layer i's output (the residual
                stream), ``num_layers`` the final normed state the output head reads. Nothing is kept
                when empty.

        Returns:
            Logits in float32, or None when ``logits="none"``; with ``features``, a pair (logits, hidden
            ``[B, T, len(features) * hidden]``, the asked layers side by side in the order given).
        """
        b, t = tokens.shape
        if invariant_rows or self.fused:  # fused layers have only the row-invariant form
            out = self.forward_rows(tokens.reshape(-1), cache, slots, [t] * b, layers, logits, features)
            logit_rows, hidden = out if features else (out, None)
            if logit_rows is not None:
                logit_rows = logit_rows.view(b, 1 if logits == "last" else t, -1)
            return (logit_rows, hidden.view(b, t, -1)) if features else logit_rows
        starts = [cache.lengths[s] for s in slots]
        cos_table, sin_table = self._rope(max(starts) + t)
        if b == 1:
            cos = cos_table[starts[0]:starts[0] + t][None, :, None]  # [1, T, 1, D]
            sin = sin_table[starts[0]:starts[0] + t][None, :, None]
        else:
            pos = torch.tensor(starts, device=self.device)[:, None] + torch.arange(t, device=self.device)  # [B, T]
            cos, sin = cos_table[pos][:, :, None], sin_table[pos][:, :, None]  # [B, T, 1, D]
        mask = self._mask([cache.visible(s) for s in slots], t)
        run = self._check_run(layers, features)
        kept: dict[int, torch.Tensor] = {}
        x = self.embed(tokens)  # [B, T, hidden]
        for i in run:
            x = self.layers[i](x, i, cache, slots, starts, cos, sin, mask)
            if i in features:
                kept[i] = x
        cache.advance(slots, t)
        return self._outputs(x, slice(None) if logits == "all" else slice(-1, None), logits, features, kept)

    def forward_rows(self, tokens: torch.Tensor, cache: Cache, slots: Sequence[int], counts: Sequence[int],
                     layers: Sequence[int] | None = None, logits: Logits | torch.Tensor = "all",
                     features: Sequence[int] = (), parents: Sequence[Sequence[int] | None] | None = None):
        """Row-invariant forward over ragged rows of several sequences (a batch's verification step).

        Every row is computed as it would be alone: projections row by row on our kernels, attention of
        each sequence over its own cache (``Block.forward_rows``), so a sequence's logits are bitwise the
        same whatever else shares the forward.

        Args:
            tokens: ``[N]`` token ids: ``counts[0]`` rows continuing the sequence in ``slots[0]``, then
                ``counts[1]`` rows of ``slots[1]``, ...
            cache: the KV cache; slot ``slots[i]`` advances by ``counts[i]``.
            slots: distinct cache slots.
            counts: rows per slot (>= 1 each, summing to N).
            layers, features: as for :meth:`forward`.
            logits: "all" rows ``[N, V]``, "last" row of each sequence ``[len(slots), V]``, "none", or the
                indices of the rows to score (``[len(indices), V]``; prompt rows in a batch need none).
            parents: per sequence, None for consecutive rows, or its rows' parents (a token tree, see
                ``tree.py``: ``parents[j] < j``, -1 = follows the context before the tree): row j then sits
                at that context's length plus its depth and sees the context, its ancestors and itself. The
                list may start with rows earlier forwards wrote (the slot's last tokens; a drafter grows a
                tree a level at a time); its last ``counts[i]`` rows are this forward's. The slot still
                advances by all its rows; ``Cache.compact`` keeps an accepted path afterwards.

        Returns:
            Logits in float32 (or None), and with ``features`` the pair (logits, hidden ``[N, F]``).
        """
        n_rows = tokens.shape[0]
        if len(counts) != len(slots) or len(set(slots)) != len(slots) or min(counts, default=0) < 1 \
                or sum(counts) != n_rows:
            raise ValueError(f"forward_rows needs distinct slots and a count >= 1 per slot summing to the "
                             f"{n_rows} rows; got slots {list(slots)}, counts {list(counts)}")
        parents = [None] * len(slots) if parents is None else list(parents)
        if len(parents) != len(slots):
            raise ValueError(f"forward_rows needs one parents entry per slot: {len(parents)} for {len(slots)} slots")
        starts = [cache.lengths[s] for s in slots]
        positions, trees = [], []
        for slot, start, n, rows in zip(slots, starts, counts, parents):
            if rows is None:
                positions += range(start, start + n)
                trees.append(None)
                continue
            tree.check_tree(range(len(rows)), rows)
            at, seen = tree.place_rows(rows, n, start, cache.visible(slot), self.config.sliding_window)
            positions += at
            trees.append(None if seen is None else (seen[0].to(self.device), seen[1].to(self.device)))
        pos = torch.tensor(positions, device=self.device)  # [N]
        run = self._check_run(layers, features)
        kept: dict[int, torch.Tensor] = {}
        if self.fused:
            x = self.embed(tokens).float()  # [N, hidden]: the fused layers keep the residual stream in fp32
            rope = (*self._rope_rows(max(positions) + 1), pos)
            buffers = cache.direct_buffers(run, slots, starts, counts)
            if buffers is not None:
                # runs of layers in one kernel call each, cut after every layer whose output is kept: no return
                # to Python (and no idle threads) between the layers of a run
                kernels = self._fused_layers if layers is None else [self.layers[i].fused for i in run]
                cuts = [0] + [j + 1 for j, i in enumerate(run) if i in features and j + 1 < len(run)] + [len(run)]
                seen_lists = [None if seen is None else list(seen) for seen in trees]
                for a, b in zip(cuts, cuts[1:]):
                    x = self.fused_ops.layers_rows(kernels[a:b], x, *rope, buffers[0][a:b], buffers[1][a:b], list(slots),
                                                   list(starts), list(counts), self.config.sliding_window or 0,
                                                   seen_lists)
                    if run[b - 1] in features:
                        kept[run[b - 1]] = x[None]
            else:
                for i in run:
                    x = self.layers[i].forward_fused(x, i, cache, slots, starts, counts, rope, trees)
                    if i in features:
                        kept[i] = x[None]
            x = x[None]
        else:
            cos_table, sin_table = self._rope(max(positions) + 1)
            cos, sin = cos_table[pos][None, :, None], sin_table[pos][None, :, None]  # [1, N, 1, D]
            x = self.embed(tokens)[None]  # [1, N, hidden]
            for i in run:
                x = self.layers[i].forward_rows(x, i, cache, slots, starts, counts, cos, sin, trees)
                if i in features:
                    kept[i] = x
        for slot, n in zip(slots, counts):
            cache.advance((slot,), n)
        if isinstance(logits, torch.Tensor):
            pick, logits = logits.to(self.device), "all"
        elif logits == "last":
            pick = (torch.tensor(counts).cumsum(0) - 1).to(self.device)  # each sequence's last row
        else:
            pick = slice(None)
        out = self._outputs(x, pick, logits, features, kept)
        if features:
            return (None if out[0] is None else out[0][0]), out[1][0]
        return None if out is None else out[0]

    def _check_run(self, layers: Sequence[int] | None, features: Sequence[int]) -> Sequence[int]:
        """The layers a forward runs; ``features`` checked against them before anything is written to the cache."""
        n = self.config.num_layers
        run = range(n) if layers is None else layers
        bad = [i for i in features if not 0 <= i <= n]
        if bad:
            raise ValueError(f"features {bad} are out of range 0..{n} (layer outputs, then {n} = the normed state)")
        missing = [i for i in features if i < n and i not in run]
        if missing:
            raise ValueError(f"features {missing} name layers this forward skips")
        return run

    def _outputs(self, x: torch.Tensor, pick: slice | torch.Tensor, logits: Logits, features: Sequence[int],
                 kept: dict[int, torch.Tensor]):
        """Logits of the rows ``x[:, pick]`` (unless "none") and, with ``features``, the kept layers side by side."""
        normed = self.config.num_layers in features
        if self.fused:  # fp32 rows [1, N, hidden]; features are handed out in the model dtype
            eps = self.config.rms_norm_eps
            if normed:
                kept[self.config.num_layers] = x = self.fused_ops.rms_norm_rows(x[0], self.norm, eps)[None]
            out = None
            if logits != "none":
                rows = x[0, pick].contiguous()
                out = self.fused_ops.project_rows(self.fused_head, rows if normed else
                                                  self.fused_ops.rms_norm_rows(rows, self.norm, eps))[None]
            kept = {i: v.to(self.dtype) for i, v in kept.items()}
        else:
            if normed:
                kept[self.config.num_layers] = x = F.rms_norm(x, (x.shape[-1],), self.norm, self.config.rms_norm_eps)
            out = None if logits == "none" else self._logits(x[:, pick], normed=normed)
        return (out, torch.cat([kept[i] for i in features], dim=-1)) if features else out

    def _logits(self, x: torch.Tensor, normed: bool) -> torch.Tensor:
        """Float32 logits of the residual stream ``x [B, T, hidden]`` (``normed``: the final norm is applied)."""
        if not normed:
            x = F.rms_norm(x, (x.shape[-1],), self.norm, self.config.rms_norm_eps)
        return self.head(x).float()

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The output head's weight rows ``[len(ids), hidden]`` for token ``ids``, in the model dtype (a
        draft head's reduced vocabulary scores with these).

        Raises:
            ValueError: the head runs on oneDNN's opaque packed layout and the model has no tied copy.
        """
        if self.config.tie_word_embeddings:
            return self.embed.weight[ids]
        if self.lm_head is not None:
            return self.lm_head.weight[ids]
        if isinstance(self.head_layer, (NativeLinear, QuantLinear)):
            return self.head_layer.weight_rows(ids).to(self.dtype)
        if isinstance(self.head_layer, Int8Linear):
            return self.head_layer.dequantized()[ids].to(self.dtype)
        raise ValueError("the output head is packed for oneDNN, which keeps no readable copy of its weights; "
                         "load the model with --linear torch or one of our kernels")

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The output head over normed states ``[..., hidden]``, in the model dtype."""
        if self.head_layer is not None:
            return self.head_layer(x)
        return F.linear(x, self.embed.weight if self.lm_head is None else self.lm_head.weight)

    def pack_weights(self, kernel: str = "auto", log: Callable[[str], None] | None = None, weights: str = "auto",
                     source: WeightSource | None = None, fuse: bool = True) -> str:
        """Swaps every projection for a pre-packed copy run by a faster kernel: bf16, or a block format.

        On our paths (tiled, avx512, avx2) attention runs on our compiled kernel too, and with ``fuse``
        each layer of a row-invariant forward runs as one kernel call (``Block.forward_fused``); elsewhere
        attention runs on ``rowwise_attention``. A tied output head keeps the embedding table for lookups
        and gains a packed copy (see ``weight_nbytes``). Packing twice is a no-op.

        Args:
            kernel: one of LINEAR_KERNELS (see ``resolve_linear_kernel``).
            log: told about a first compile of one of our kernels.
            weights: one of WEIGHT_FORMATS: "bf16", a block format for every projection (the output head
                at least q8_0, see ``weights.choose_format``), or "auto": as ``source`` stores them where our
                kernels run (the GGUF's own blocks), else bf16.
            source: the checkpoint's float weights and stored formats (``Checkpoint.weights``); without it,
                block formats are quantized from the model's own weights.
            fuse: run layers as single kernel calls on our paths (False keeps one torch op per step, to
                measure the difference).

        Returns:
            The path the projections now run on: "tiled", "avx512", "avx2", "onednn" or "torch".

        Raises:
            ValueError: an unknown kernel or format, or one that cannot run this model here (the reason is named).
        """
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weight format {weights!r} is not one of {', '.join(WEIGHT_FORMATS)}")
        if self.head_layer is not None:
            current = self.linear_kernel
            same_weights = weights in ("auto", self._packed_as, self.weight_format)
            if kernel in ("auto", current) and same_weights:
                return current
            if not same_weights:
                raise ValueError(f"the projections are already packed with {self.weight_format} weights on {current}; "
                                 f"cannot repack them as {weights}")
            raise ValueError(f"the projections already run on {current}; cannot switch to {kernel}")
        kernel = resolve_linear_kernel(kernel, self.dtype, self.device, log)
        if weights in BLOCK_FORMATS and kernel not in NATIVE_KERNELS:
            raise ValueError(f"{weights} weights need one of our kernels ({', '.join(NATIVE_KERNELS)}); the projections "
                             f"of this model run on {kernel}")
        if kernel not in NATIVE_KERNELS:
            weights = "bf16"  # "auto" off our kernels: no block formats there
        self._packed_as = weights
        if kernel in ("onednn", *NATIVE_KERNELS):
            self._swap_projections(lambda layer, parts, head: self._projection(layer, parts, head, kernel, weights, source))
        if kernel in NATIVE_KERNELS:
            ops = native.kernel(kernel)
            for block in self.layers:
                block.attention_ops = attention_ops(kernel, log)
                if fuse:
                    block.fuse(ops)
            if fuse:
                self.fused_ops, self.fused_head = ops, self.head_layer.proj()
                self._fused_layers = [block.fused for block in self.layers]  # read every forward: a plain list
        elif kernel == "onednn":
            for block in self.layers:
                block.attention_ops = attention_ops(kernel, log)
        return kernel

    @staticmethod
    def _projection(layer: nn.Module, parts: list[str], head: bool, kernel: str, weights: str,
                    source: WeightSource | None) -> nn.Module:
        """One packed projection: bf16, or the format ``weights`` asks for, from ``source``'s stored blocks
        where they already are in that format (no round trip), else quantized from the float weights."""
        fmt = choose_format(weights, [source.format(f"{p}.weight") for p in parts] if source else ["bf16"], head)
        if fmt == "bf16":
            return packed_linear(layer.weight, layer.bias, kernel)
        if source is None:
            blocks = quantize(layer.weight, fmt)
        else:  # stored blocks are read only where they can be kept
            blocks = concat([as_format(source.blocks(f"{p}.weight") if source.format(f"{p}.weight") == fmt else None,
                                       source.tensors[f"{p}.weight"], fmt) for p in parts])
        bias = layer.bias
        if bias is not None and source is not None:  # the checkpoint's fp32 biases, not the bf16 copies
            bias = torch.cat([source.tensors[f"{p}.bias"] for p in parts])
        return QuantLinear(blocks, bias, kernel)

    @property
    def weight_format(self) -> str:
        """The projections' formats, e.g. "bf16", "q4_1" or "q4_1+q8_0, head q8_0" (the head named where it
        differs); "int8" for ``quantize_weights``; the model dtype ("float32", ...) for unpacked weights."""
        dtype = {torch.bfloat16: "bf16"}.get(self.dtype, str(self.dtype).replace("torch.", ""))

        def fmt(m: nn.Module | None) -> str:
            if isinstance(m, Int8Linear):
                return "int8"
            return m.weight_format if isinstance(m, (NativeLinear, QuantLinear)) else dtype

        layers = sorted({fmt(getattr(b, n)) for b in self.layers for n in ("wqkv", "wo", "w_gate_up", "w_down")})
        head = fmt(self.head_layer)
        text = "+".join(layers) or head
        return text if layers == [head] or not layers else f"{text}, head {head}"

    @property
    def linear_kernel(self) -> str:
        """What the projections run on: "tiled", "avx512", "avx2", "onednn", "int8" or "torch"."""
        if isinstance(self.head_layer, (NativeLinear, QuantLinear)):
            return self.head_layer.path
        kinds = {PackedLinear: "onednn", Int8Linear: "int8"}
        return kinds.get(type(self.head_layer), "torch")

    @property
    def row_invariant(self) -> bool:
        """Whether every projection computes a row the same at any row count (our kernels): then one
        forward's rows equal what separate forwards give, whatever the split. oneDNN and F.linear round a
        one-row matmul (GEMV) differently from a multi-row one (GEMM)."""
        return isinstance(self.head_layer, (NativeLinear, QuantLinear))

    def quantize_weights(self) -> None:
        """Replaces every projection (and the output head) with int8 weight-only copies.

        Meant for draft models: about half the bytes per step of bf16, and different numbers (see
        ``models/linear.py``). The embedding table stays in the model dtype.
        """
        if self.head_layer is not None:
            raise ValueError("quantize_weights() needs plain weights (this model is already packed or quantized)")
        self._swap_projections(lambda layer, parts, head: Int8Linear(layer.weight, layer.bias, self.dtype))

    def _swap_projections(self, make: Callable[[nn.Module, list[str], bool], nn.Module]) -> None:
        """Replaces each projection by ``make(layer, its checkpoint names, is the output head)``."""
        for i, block in enumerate(self.layers):
            for name, parts in projection_parts(i).items():
                setattr(block, name, make(getattr(block, name), parts, False))
        head = self.lm_head or _HeadView(self.embed.weight)
        self.head_layer, self.lm_head = make(head, [head_part(self.config)], True), None

    @property
    def weight_nbytes(self) -> int:
        """Bytes held by the weights, packed and quantized copies included."""
        held = sum(t.numel() * t.element_size() for t in [*self.parameters(), *self.buffers()])
        return held + sum(m.nbytes for m in self.modules() if isinstance(m, PackedLinear))

    def _mask(self, seen: list[int], t: int) -> torch.Tensor | None:
        """Boolean attention mask ``[B, 1, T, L]``: query i of row b sees returned entries <= seen[b] + i."""
        if t == 1 and len(set(seen)) == 1:
            return None  # one new token per row, all rows equally long: every key is visible
        end = max(seen) + t
        query_pos = torch.tensor(seen, device=self.device)[:, None] + torch.arange(t, device=self.device)  # [B, T]
        key_pos = torch.arange(end, device=self.device)
        visible = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, T, L]
        if self.config.sliding_window is not None:
            visible &= key_pos[None, None, :] > query_pos[:, :, None] - self.config.sliding_window
        return visible[:, None]  # [B, 1, T, L]

    @classmethod
    def from_hf_tensors(cls, config: ModelConfig, tensors: Mapping[str, torch.Tensor],
                        dtype: torch.dtype = torch.float32) -> "Transformer":
        """Builds the model from HF-named weights, fusing q/k/v and gate/up.

        Args:
            config: the architecture.
            tensors: weights named as in HF checkpoints (``model.layers.0.self_attn.q_proj.weight`` ...).
            dtype: parameter dtype.
        """
        with torch.device("meta"):
            model = cls(config)
        missing = [n for n in expected_tensor_shapes(config) if n not in tensors]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        state = {"embed.weight": tensors["model.embed_tokens.weight"], "norm": tensors["model.norm.weight"]}
        if not config.tie_word_embeddings:
            state["lm_head.weight"] = tensors["lm_head.weight"]
        for i in range(config.num_layers):
            for name, parts in projection_parts(i).items():
                state[f"layers.{i}.{name}.weight"] = torch.cat([tensors[f"{p}.weight"] for p in parts])
            if config.attention_bias:
                state[f"layers.{i}.wqkv.bias"] = torch.cat([tensors[f"{p}.bias"] for p in projection_parts(i)["wqkv"]])
            p = f"model.layers.{i}."
            state[f"layers.{i}.attn_norm"] = tensors[f"{p}input_layernorm.weight"]
            state[f"layers.{i}.mlp_norm"] = tensors[f"{p}post_attention_layernorm.weight"]
        state = {k: v.to(dtype) for k, v in state.items()}
        model.load_state_dict(state, strict=True, assign=True)
        model.inv_freq = rope_inv_freq(config)
        return model.eval().requires_grad_(False)
