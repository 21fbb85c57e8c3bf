"""A Llama/Qwen2/Mistral-family decoder that runs over a KV cache (:class:`~specdecode.kv.cache.Cache`).

One forward takes any number of new tokens per sequence (prefill, one decode step, or a draft to
verify), writes their keys/values into the cache by index and can run a subset of its layers
(self-speculation). Projections are fused (q/k/v in one matmul, gate/up in another) because on a
CPU the per-call overhead of small matmuls dominates small models.

It does not load files (see ``loader.py``), sample, or decide what to keep in the cache: callers
trim the cache after a forward when draft tokens are rejected.
"""

from __future__ import annotations

import math
from typing import Literal, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.kv.cache import Cache, CacheConfig
from specdecode.kv.factory import make_cache
from specdecode.models.config import ModelConfig, expected_tensor_shapes

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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x [B, H, T, D]`` by angles given as ``cos``/``sin [B, 1, T, D]`` (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def one_query_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Attention of one query per row over all given keys, as two small matmuls.

    For a single query the fused CPU kernel costs several times more than the arithmetic; this
    computes scores in the model dtype and the softmax in float32, like transformers' eager attention.

    Args:
        q: ``[B, H, 1, D]``.
        keys: ``[B, Hkv, L, D]`` (H a multiple of Hkv: query heads h*G..h*G+G-1 share key head h).
        values: ``[B, Hkv, L, D]``.

    Returns:
        ``[B, H, 1, D]``.
    """
    b, h, _, d = q.shape
    grouped = q.view(b, keys.shape[1], h // keys.shape[1], d)  # [B, Hkv, G, D]
    scores = torch.matmul(grouped, keys.transpose(-1, -2)) * d ** -0.5  # [B, Hkv, G, L]
    probs = scores.float().softmax(-1).to(values.dtype)
    return torch.matmul(probs, values).view(b, h, 1, d)


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

    def _first(self, end: int) -> int:
        """First returned entry a query at entry ``end - 1`` may see (Mistral's sliding window, counted in
        the entries the cache returned: positions for a plain cache)."""
        return 0 if self.window is None else max(0, end - self.window)

    def forward(self, x: torch.Tensor, layer: int, cache: Cache, slots: Sequence[int], starts: Sequence[int],
                cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None, invariant_rows: bool) -> torch.Tensor:
        b, t, _ = x.shape
        h = F.rms_norm(x, (x.shape[-1],), self.attn_norm, self.eps)
        qkv = self.wqkv(h)
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                             self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = cache.update(layer, slots, starts, k, v)  # [B, Hkv, L, D]
        if invariant_rows and t > 1:
            # One call per new token over exactly the keys it sees: the same kernel, shapes and summation
            # order as one-token decoding, so a verified token's numbers do not depend on the draft length.
            # The new tokens are the last t entries the cache returned (a window may have dropped older ones).
            ends = [keys.shape[2] - t + 1 + i for i in range(t)]
            attn = torch.cat([one_query_attention(q[:, :, i:i + 1], keys[:, :, self._first(e):e],
                                                  values[:, :, self._first(e):e]) for i, e in enumerate(ends)],
                             dim=2)  # [1, H, T, D]
        elif mask is None:  # one new token per row, all rows equally long (the window, if any, is a slice)
            first = self._first(keys.shape[2])
            attn = one_query_attention(q, keys[:, :, first:], values[:, :, first:])
        else:
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                  enable_gqa=self.heads != self.kv_heads)
        x = x + self.wo(attn.transpose(1, 2).reshape(b, t, -1))
        h = F.rms_norm(x, (x.shape[-1],), self.mlp_norm, self.eps)
        gate, up = self.w_gate_up(h).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)


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
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self._rope_cache: tuple[int, torch.Tensor, torch.Tensor] | None = None

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
            angles = torch.outer(torch.arange(n, dtype=torch.float32, device=self.device), self.inv_freq)
            angles = torch.cat((angles, angles), dim=-1)  # [n, D]
            self._rope_cache = (n, angles.cos().to(self.dtype), angles.sin().to(self.dtype))
        return self._rope_cache[1], self._rope_cache[2]

    def forward(self, tokens: torch.Tensor, cache: Cache, slots: Sequence[int] = (0,),
                layers: Sequence[int] | None = None, logits: Logits = "all",
                invariant_rows: bool = False) -> torch.Tensor | None:
        """Runs new tokens through the model, appending their keys/values to the cache.

        Args:
            tokens: ``[B, T]`` new token ids, row b continuing the sequence in ``slots[b]``.
            cache: the KV cache; each slot's length advances by T.
            slots: cache slot of each row.
            layers: indices of the layers to run (self-speculation); None runs all of them.
            logits: "all" positions ``[B, T, V]``, "last" position ``[B, 1, V]``, or "none" (prefill).
            invariant_rows: compute attention one new token at a time (single sequence only), so that
                each row's result is bitwise what a one-token forward would give. With a fused attention
                kernel the summation order depends on how many queries share a call; the linear layers
                are row-invariant in bf16 on x86 CPUs for small models (see tests), so this makes greedy
                verification reproduce one-token decoding exactly. Costs T-1 extra attention calls.

        Returns:
            Logits in float32, or None when ``logits="none"``.
        """
        b, t = tokens.shape
        if invariant_rows and b != 1:
            raise ValueError("invariant_rows supports a single sequence (B=1)")
        starts = [cache.lengths[s] for s in slots]
        cos_table, sin_table = self._rope(max(starts) + t)
        if b == 1:
            cos = cos_table[starts[0]:starts[0] + t][None, None]  # [1, 1, T, D]
            sin = sin_table[starts[0]:starts[0] + t][None, None]
        else:
            pos = torch.tensor(starts, device=self.device)[:, None] + torch.arange(t, device=self.device)  # [B, T]
            cos, sin = cos_table[pos][:, None], sin_table[pos][:, None]  # [B, 1, T, D]
        seen = [cache.visible(s) for s in slots]  # entries update() returns before each row's new tokens
        mask = None if invariant_rows else self._mask(seen, t)  # the row-by-row path needs none
        x = self.embed(tokens)  # [B, T, hidden]
        for i in range(self.config.num_layers) if layers is None else layers:
            x = self.layers[i](x, i, cache, slots, starts, cos, sin, mask, invariant_rows)
        cache.advance(slots, t)
        if logits == "none":
            return None
        if logits == "last":
            x = x[:, -1:]
        x = F.rms_norm(x, (x.shape[-1],), self.norm, self.config.rms_norm_eps)
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, head).float()

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
            p = f"model.layers.{i}."
            attn = [tensors[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"]
            state[f"layers.{i}.wqkv.weight"] = torch.cat(attn)
            if config.attention_bias:
                state[f"layers.{i}.wqkv.bias"] = torch.cat([tensors[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"])
            state[f"layers.{i}.wo.weight"] = tensors[f"{p}self_attn.o_proj.weight"]
            state[f"layers.{i}.attn_norm"] = tensors[f"{p}input_layernorm.weight"]
            state[f"layers.{i}.mlp_norm"] = tensors[f"{p}post_attention_layernorm.weight"]
            state[f"layers.{i}.w_gate_up.weight"] = torch.cat([tensors[f"{p}mlp.gate_proj.weight"],
                                                               tensors[f"{p}mlp.up_proj.weight"]])
            state[f"layers.{i}.w_down.weight"] = tensors[f"{p}mlp.down_proj.weight"]
        state = {k: v.to(dtype) for k, v in state.items()}
        model.load_state_dict(state, strict=True, assign=True)
        model.inv_freq = rope_inv_freq(config)
        return model.eval().requires_grad_(False)
