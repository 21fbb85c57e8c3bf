"""One pre-norm decoder layer of the Llama/Qwen2/Qwen3/Mistral/Gemma 3 family as torch modules: attention with
GQA (Qwen3's and Gemma's per-head query/key RMSNorm before RoPE), then a SwiGLU (Gemma: GeGLU) MLP, with q/k/v
fused into one projection and gate/up into another (on a CPU the per-call overhead of small matmuls dominates
small models). Gemma's extra norms after attention and after the MLP sit before their residual adds.

Its projections are whatever a backend packed in (``backends/``); its row-invariant attention is our
compiled kernel where a backend set ``attention_ops``, else ``attention.rowwise_attention``. A backend that
runs whole layers as one kernel call (``backends/compiled.py``) reads this block's weights and does not call
these forwards. This module does not choose a backend, place rows or touch the output head.
"""

from __future__ import annotations

from types import ModuleType
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.kv.cache import Cache
from specdecode.models.attention import indexed_attention, rowwise_attention
from specdecode.models.config import Activation, ModelConfig
from specdecode.models.rope import apply_rope
from specdecode.models.rows import RowPlan


class Block(nn.Module):
    """One decoder layer.

    Args:
        config: the architecture.
        layer: its index (its attention window and RoPE base may depend on it).
    """

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        c = config
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.eps = c.rms_norm_eps
        self.window = c.window_of(layer)
        self.scale = c.attention_scale
        self.activation = c.activation
        self.attn_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.wqkv = nn.Linear(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=c.attention_bias)
        self.wo = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(c.hidden_size))
        # Qwen3, Gemma: an RMSNorm over each query and key head before RoPE
        self.q_norm = nn.Parameter(torch.ones(c.head_dim)) if c.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(c.head_dim)) if c.qk_norm else None
        # Gemma: RMSNorms of attention's and the MLP's outputs, before each residual add
        self.post_attn_norm = nn.Parameter(torch.ones(c.hidden_size)) if c.sandwich_norms else None
        self.post_mlp_norm = nn.Parameter(torch.ones(c.hidden_size)) if c.sandwich_norms else None
        self.w_gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.w_down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.attention_ops: ModuleType | None = None  # our compiled attention, set by a backend (``native``)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Row-invariant attention of the T newest tokens (``[B, H, T, D]``) over the keys (``[B, Hkv, L, D]``):
        our kernel where a backend set it, else ``rowwise_attention``."""
        if self.attention_ops is not None:
            return self.attention_ops.attention(q, keys, values, self.window or 0, self.scale)
        return rowwise_attention(q, keys, values, self.window, self.scale)

    def attend_indexed(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor,
                       counts: torch.Tensor) -> torch.Tensor:
        """Row-invariant attention of one sequence's T new tokens (``[1, H, T, D]``), token t over the keys
        ``index[t, :counts[t]]`` (a token tree, ``tree.key_index``): our kernel, else ``indexed_attention``."""
        if self.attention_ops is not None:
            return self.attention_ops.attention_indexed(q, keys, values, index, counts, self.scale)
        return indexed_attention(q, keys, values, index, counts, self.scale)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[B, H, T, D]``, keys and values ``[B, Hkv, T, D]`` of ``x [B, T, hidden]``, RoPE applied."""
        b, t, _ = x.shape
        h = self._norm(x, self.attn_norm)
        qkv = self.wqkv(h).view(b, t, self.heads + 2 * self.kv_heads, self.head_dim)  # [B, T, H + 2 Hkv, D]
        qk = qkv[:, :, :self.heads + self.kv_heads]
        if self.q_norm is not None:
            d = (self.head_dim,)
            qk = torch.cat([self._norm(qk[:, :, :self.heads], self.q_norm),
                            self._norm(qk[:, :, self.heads:], self.k_norm)], dim=2)
        qk = apply_rope(qk, cos, sin)  # queries and keys in one go
        q = qk[:, :, :self.heads].transpose(1, 2)  # [B, H, T, D]
        k = qk[:, :, self.heads:].transpose(1, 2)  # [B, Hkv, T, D]
        return q, k, qkv[:, :, self.heads + self.kv_heads:].transpose(1, 2)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream after the output projection of ``attn [B, H, T, D]`` and the MLP."""
        b, t, _ = x.shape
        x = x + self._post_norm(self.wo(attn.transpose(1, 2).reshape(b, t, -1)), self.post_attn_norm)
        h = self._norm(x, self.mlp_norm)
        gate, up = self.w_gate_up(h).chunk(2, dim=-1)
        act = F.silu(gate) if self.activation == Activation.SILU else F.gelu(gate, approximate="tanh")
        return x + self._post_norm(self.w_down(act * up), self.post_mlp_norm)

    def _post_norm(self, y: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return y if weight is None else self._norm(y, weight)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dimension; a norm weight kept in fp32 (``hf_import.param_dtype``) is used in the
        rows' dtype here, as it always was: only the fused layers read it at full precision."""
        return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), self.eps)

    def forward(self, x: torch.Tensor, layer: int, cache: Cache, slots: Sequence[int], starts: Sequence[int],
                cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The batched path: all rows of ``x [B, T, hidden]`` attend in one call under ``mask``
        (``attention.batch_mask``; None: every key visible, then attention is row-invariant)."""
        q, k, v = self.qkv(x, cos, sin)
        keys, values = cache.update(layer, slots, starts, k, v)  # [B, Hkv, L, D]
        if mask is None:
            attn = self.attend(q, keys, values)  # [B, H, T, D]
        else:
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale,
                                                  enable_gqa=self.heads != self.kv_heads)
        return self.finish(x, attn)

    def forward_rows(self, x: torch.Tensor, layer: int, cache: Cache, plan: RowPlan, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
        """The row-invariant path: ``x [1, N, hidden]`` holds the rows ``plan`` places; each sequence's rows
        attend over its own cache alone (``attend``), or, where ``plan.trees`` gives a key index, each row over
        its context and ancestors, so a row's result does not depend on what else shares the forward.
        ``cos``/``sin`` are the rows' RoPE angles ``[1, N, 1, D]``."""
        q, k, v = self.qkv(x, cos, sin)  # q [1, H, N, D], k/v [1, Hkv, N, D]
        parts, offset = [], 0
        for slot, start, n, seen in zip(plan.slots, plan.starts, plan.counts, plan.trees):
            rows = slice(offset, offset + n)
            keys, values = cache.update(layer, (slot,), (start,), k[:, :, rows], v[:, :, rows])  # [1, Hkv, L, D]
            if seen is None:
                parts.append(self.attend(q[:, :, rows], keys, values))
            else:
                parts.append(self.attend_indexed(q[:, :, rows], keys, values, *seen))
            offset += n
        return self.finish(x, parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
