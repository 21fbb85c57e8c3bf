"""Rotary position embeddings: the inverse frequencies (with the config's scaling), the tables the layers
read, and the rotation itself.

Two table forms serve two kinds of layers: ``rope_tables`` (model dtype, ``[P, D]``, one angle per half,
the sine's first half negated) for the torch-op layers' ``apply_rope``, and ``rope_rows`` (fp32, ``[P, D/2]``,
angles in float64) for our fused layers (``kernels/layer.h``). :class:`Rope` keeps both, grown by doubling,
for each kind of layer: the model's own, and Gemma 3's windowed ones with their base, unscaled.

This module does not run attention or decide positions (``rows.py`` places a forward's rows).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from specdecode.models.config import ModelConfig

FIRST_TABLE = 256  # positions in a first table; later ones double


def rope_inv_freq(config: ModelConfig, layer: int = 0) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` of layer ``layer`` with the config's RoPE scaling applied, on the
    CPU (also while a model is built on the meta device, where torch's own arange would first import seconds of
    decompositions). Layers with a base of their own (``local_rope_theta``) are not scaled."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta_of(layer) ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    scaling = (None if config.local_rope(layer) else config.rope_scaling) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv.float()
    if kind == "linear":
        return (inv / scaling["factor"]).float()
    if kind == "freq_factors":  # llama.cpp's form of llama3 scaling: each frequency divided by its stored factor
        factors = torch.tensor(scaling["factors"], dtype=torch.float64, device="cpu")
        if factors.shape != inv.shape:
            raise ValueError(f"rope_scaling factors: {factors.numel()} values for {inv.numel()} frequencies")
        return (inv / factors).float()
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old_ctx / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled).float()
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3, "
                     "freq_factors)")


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

    ``sin`` comes with its first half negated (see ``rope_tables``), so the rotation is one roll:
    ``x * cos + roll(x, D/2) * sin`` equals ``x * cos + cat(-x2, x1) * sin`` bitwise.
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class Rope(nn.Module):
    """A model's RoPE frequencies (a buffer: it moves with the model) and its tables, built on first need
    and rebuilt by doubling, so that a long generation rebuilds them O(log n) times. Tables have one entry per
    kind of layer (K = 2 where some layers are local ones, ``ModelConfig.local_rope``; else 1): layer i reads
    entry ``kind[i]``.

    Args:
        config: the architecture (head size, theta per layer, scaling).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        local = [config.local_rope(i) for i in range(config.num_layers)]
        kinds = sorted(set(local))  # the model's own base first, where a layer has it
        self.kind = tuple(kinds.index(is_local) for is_local in local)
        first = [local.index(is_local) for is_local in kinds]  # a layer of each kind
        self.register_buffer("inv_freq", torch.stack([rope_inv_freq(config, i) for i in first]),  # [K, D/2]
                             persistent=False)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def tables(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[K, >= length, D]`` in ``dtype`` on the frequencies' device (``rope_tables``)."""
        held, device = self._tables, self.inv_freq.device
        if held is None or held[0].shape[1] < length or held[0].dtype != dtype or held[0].device != device:
            grown = 2 * held[0].shape[1] if held is not None else FIRST_TABLE
            tables = [rope_tables(inv, max(length, grown), dtype) for inv in self.inv_freq]
            self._tables = held = torch.stack([c for c, _ in tables]), torch.stack([s for _, s in tables])
        return held

    def rows(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``cos``, ``sin`` ``[K, >= length, D/2]`` on the CPU, for our fused layers (``rope_rows``)."""
        held = self._rows
        if held is None or held[0].shape[1] < length:
            grown = 2 * held[0].shape[1] if held is not None else FIRST_TABLE
            rows = [rope_rows(inv, max(length, grown)) for inv in self.inv_freq]
            self._rows = held = torch.stack([c for c, _ in rows]), torch.stack([s for _, s in rows])
        return held
