"""Picks the cache kind a :class:`~specdecode.kv.cache.CacheConfig` asks for.

Plain float caches (``auto``, ``bfloat16``, ``float32`` without a window) are :class:`KVCache`; int8/int4
and windows are :class:`CompressedCache`. This module builds caches; it does not size or budget them
(see ``memory.py``).
"""

from __future__ import annotations

import torch

from specdecode.kv.cache import FLOAT_DTYPES, Cache, CacheConfig, KVCache
from specdecode.kv.compressed import CompressedCache


def make_cache(num_layers: int, kv_heads: int, head_dim: int, config: CacheConfig, dtype: torch.dtype,
               device: torch.device | str = "cpu") -> Cache:
    """A cache for a model of this geometry.

    Args:
        num_layers: decoder layers.
        kv_heads: key/value heads per layer.
        head_dim: width of one head.
        config: sizes and compression settings.
        dtype: the model's dtype (used for full-precision entries when ``kv_dtype`` is "auto" or int8/int4).
        device: where the buffers live ("meta" sizes a cache without allocating it).
    """
    if config.compressed:
        return CompressedCache(num_layers, kv_heads, head_dim, config, dtype=dtype, device=device)
    return KVCache(num_layers, kv_heads, head_dim, config, dtype=FLOAT_DTYPES.get(config.kv_dtype, dtype),
                   device=device)
