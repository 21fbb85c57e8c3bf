"""Attention of new tokens over a KV cache's keys, in torch ops: the batched form with a mask, and the
row-invariant forms (one new token per call) that make a verification forward reproduce decoding.

Our compiled attention (``kernels/``) computes the same row-invariant forms; ``Block`` picks between them.
This module does not read or write a cache, and does not project queries, keys or values.
"""

from __future__ import annotations

from typing import Sequence

import torch


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      scale: float | None = None) -> torch.Tensor:
    """Attention of the T newest tokens over all the given keys, as two batched matmuls per call.

    The query heads sharing a key head are stacked as rows of one matmul, so no key is repeated. Scores
    are computed in the model dtype and the softmax in float32, like transformers' eager attention.
    Whether a row's result depends on how many rows share the call is up to the matmul library (on one
    Intel CPU it did for bf16 at 717 keys): ``rowwise_attention`` calls it one new token at a time.

    Args:
        q: ``[B, H, T, D]``, the queries of the last T positions of ``keys``.
        keys: ``[B, Hkv, L, D]`` (H a multiple of Hkv: query heads h*G..h*G+G-1 share key head h).
        values: ``[B, Hkv, L, D]``.
        scale: what scores are multiplied by; None: ``D ** -0.5``.

    Returns:
        ``[B, H, T, D]``.
    """
    b, h, t, d = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(b, kv_heads, (h // kv_heads) * t, d)  # [B, Hkv, G*T, D]
    scale = d ** -0.5 if scale is None else scale
    scores = (torch.matmul(grouped, keys.transpose(-1, -2)) * scale).float()  # [B, Hkv, G*T, L]
    probs = scores.softmax(-1).to(values.dtype)
    return torch.matmul(probs, values).view(b, h, t, d)


def rowwise_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention of the T newest tokens, each over exactly its own keys by one ``grouped_attention`` call.

    Each call is the one a one-token decode step at that position makes, so every row is bitwise what
    decoding computes, on any device and library: row-invariant by construction, at T calls per layer.

    Args:
        q: ``[B, H, T, D]``, the queries of the last T positions of ``keys``.
        keys: ``[B, Hkv, L, D]``.
        values: ``[B, Hkv, L, D]``.
        window: each token sees at most its last ``window`` keys (a sliding window), or None.
        scale: as for ``grouped_attention``.

    Returns:
        ``[B, H, T, D]``.
    """
    t, length = q.shape[2], keys.shape[2]
    rows = []
    for i in range(t):
        end = length - t + i + 1
        start = 0 if window is None else max(0, end - window)
        rows.append(grouped_attention(q[:, :, i:i + 1], keys[:, :, start:end], values[:, :, start:end], scale))
    return rows[0] if t == 1 else torch.cat(rows, dim=2)


def indexed_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor,
                      counts: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Attention of each new token over its own list of keys (a token tree), one ``grouped_attention`` call
    per token: a token whose keys form one range gets the call ``rowwise_attention`` makes for it.

    Args:
        q: ``[1, H, T, D]``.
        keys: ``[1, Hkv, L, D]``.
        values: ``[1, Hkv, L, D]``.
        index: ``[T, M]`` key indices per token (see ``tree.key_index``); ``counts [T]`` how many are used.
        scale: as for ``grouped_attention``.

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
        rows.append(grouped_attention(q[:, :, i:i + 1], k, v, scale))
    return torch.cat(rows, dim=2)


def batch_mask(seen: Sequence[int], t: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean attention mask ``[B, 1, T, L]`` of a batched forward: query i of row b sees the cache entries
    at or before ``seen[b] + i`` (and, with a sliding ``window``, after ``seen[b] + i - window``); None
    where every key is visible (one new token per row, all rows equally long)."""
    if t == 1 and len(set(seen)) == 1:
        return None
    end = max(seen) + t
    query_pos = torch.tensor(seen, device=device)[:, None] + torch.arange(t, device=device)  # [B, T]
    key_pos = torch.arange(end, device=device)
    visible = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, T, L]
    if window is not None:
        visible &= key_pos[None, None, :] > query_pos[:, :, None] - window
    return visible[:, None]  # [B, 1, T, L]
