"""An EAGLE-style draft head: one decoder layer that predicts the target's next feature.

Row j of the head's input fuses the target's feature f_j at position j with the embedding of token
x_{j+1}: ``fc([embed(x_{j+1}), f_j])``. One decoder layer (the target's layer shapes, its RoPE, its own KV
cache over earlier rows) turns that into f'_{j+1}, a prediction of the target's normed final state
f_{j+1}, and the target's own output head, restricted to a draft vocabulary, scores the next token from
it. Drafting feeds the head its own predictions after the target's last real feature. The embedding table
and the output head are the target's, frozen; the head owns fc, the layer and (fused heads) ``fuse``.

The target's feature f_j is its normed final state (EAGLE-1), or, with ``fuse_layers`` (EAGLE-3-style),
several of its layers' outputs side by side, each RMS-normalised and projected to one hidden size by ``fuse``
(``lift``): lower layers still hold what the top layer has already narrowed to the next token alone.

This module holds the network and its two forwards (cached, for drafting; whole sequences, for
training). It does not draft (``drafters/eagle.py``), train (``train.py``) or read files (``file.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.kv.cache import Cache, CacheConfig
from specdecode.kv.factory import make_cache
from specdecode.models import packing
from specdecode.models.backends import TORCH, Backend, LayerRunner
from specdecode.models.backends.base import block_formats_refused
from specdecode.models.block import Block
from specdecode.models.config import ModelConfig
from specdecode.models.rope import Rope
from specdecode.models.rows import plan_rows
from specdecode.models.weights import quantize


@dataclass(frozen=True)
class EagleConfig:
    """The head's architecture.

    Args:
        layer: one layer shaped like the target's (its config with num_layers = 1).
        fuse_layers: the target's feature indices the head reads (``Transformer.forward``'s ``features``:
            i < num_layers is layer i's output, num_layers the normed final state). Empty: the normed final
            state alone, unprojected (EAGLE-1).
    """

    layer: ModelConfig
    fuse_layers: tuple[int, ...] = ()

    @classmethod
    def for_target(cls, target: ModelConfig, fuse_layers: Sequence[int] = ()) -> "EagleConfig":
        check_fuse_layers(fuse_layers, target.num_layers)
        layer = replace(target, num_layers=1, sliding_window=None, window_layers=None, local_rope_theta=None)
        return cls(layer, tuple(fuse_layers))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layer": self.layer.to_hf()}
        if self.fuse_layers:
            out["fuse_layers"] = list(self.fuse_layers)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EagleConfig":
        return cls(ModelConfig.from_hf(data["layer"]), tuple(data.get("fuse_layers", ())))


def check_fuse_layers(layers: Sequence[int], num_layers: int) -> None:
    """Refuses feature indices a ``num_layers``-layer target does not have, or one given twice."""
    bad = [i for i in layers if not 0 <= i <= num_layers]
    if bad or len(set(layers)) != len(layers):
        raise ValueError(f"fuse layers {list(layers)}: each must be one of 0..{num_layers} (layer outputs, then "
                         f"{num_layers} = the normed final state), none twice")


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high features of a ``num_layers``-layer target in EAGLE-3's manner: an early layer's
    output (the third, or earlier in a shallow model), the middle layer's, and, for the high one, the normed
    final state (EAGLE-3 reads a layer three below the top instead; the normed state keeps what an EAGLE-1
    head reads)."""
    return tuple(sorted({max(0, min(2, num_layers // 2 - 1)), num_layers // 2, num_layers}))


class EagleHead(nn.Module):
    """fc (2h -> h, with bias) and one decoder layer; with fused layers also ``fuse`` (F x h -> h).

    Args:
        config: the architecture.
    """

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.head_config = config
        self.config = config.layer  # what KVMemory reads to size the head's cache
        h = config.layer.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        n = len(config.fuse_layers)
        self.fuse = nn.Linear(n * h, h, bias=False) if n else None
        self.block = Block(config.layer)
        self.rope = Rope(config.layer)
        self.runner: LayerRunner = TORCH.prepare([self.block], self.rope, None)  # its layer as pack() readies it

    @property
    def dtype(self) -> torch.dtype:
        return self.block.attn_norm.dtype  # a parameter that packing leaves in place

    @property
    def device(self) -> torch.device:
        return self.block.attn_norm.device

    def normalize(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features ``[..., F*h]`` with each layer's part RMS-normalised (the residual stream's
        scale grows with depth); the normed final state alone is returned as it is."""
        if self.fuse is None:
            return features
        n = len(self.head_config.fuse_layers)
        parts = features.unflatten(-1, (n, features.shape[-1] // n))  # [..., F, h]
        return F.rms_norm(parts, (parts.shape[-1],), eps=self.config.rms_norm_eps).flatten(-2)

    def project(self, normalized: torch.Tensor) -> torch.Tensor:
        """``normalize``'s output ``[..., F*h]`` -> the head's input feature ``[..., h]``."""
        return normalized if self.fuse is None else self.fuse(normalized)

    def lift(self, features: torch.Tensor) -> torch.Tensor:
        """The head's input feature ``[..., h]`` of the target's features ``[..., F*h]`` (its real rows;
        drafted rows feed the head's own outputs instead)."""
        return self.project(self.normalize(features))

    def pack_like(self, target) -> None:
        """``pack`` on the target's backend, in q8_0 where the target computes with block formats."""
        self.pack(target.backend, "q8_0" if packing.block_weights(target) else "bf16")

    def pack(self, backend: Backend, weights: str = "bf16") -> None:
        """Runs the projections and the layer on ``backend`` (the target's), as ``packing.pack``
        does for the target: packed projections, and on our kernels our attention and the layer as one call.
        A backend that packs nothing (torch) leaves the head as it is.

        Args:
            backend: the target's backend.
            weights: "bf16" (the head's own dtype) or a block format (e.g. "q8_0", on a backend that computes
                them): half the bytes a drafted token streams, at a draft's usual cost of a slightly different guess.
        """
        if not backend.packs:
            return
        if weights != "bf16" and not backend.block_formats:
            raise block_formats_refused(weights, backend)

        def project(layer: nn.Linear) -> nn.Module:
            if weights == "bf16":
                return backend.linear(layer.weight, layer.bias)
            return backend.block_linear(quantize(layer.weight.float(), weights), layer.bias)

        self.fc = project(self.fc)
        if self.fuse is not None:
            self.fuse = project(self.fuse)
        for name in packing.PROJECTIONS:
            setattr(self.block, name, project(getattr(self.block, name)))
        self.runner = backend.prepare([self.block], self.rope, None)

    def new_cache(self, config: CacheConfig) -> Cache:
        c = self.config
        return make_cache(1, c.num_kv_heads, c.head_dim, config, dtype=self.dtype, device=self.device)

    def step(self, embedded: torch.Tensor, features: torch.Tensor, cache: Cache,
             parents: Sequence[int] | None = None) -> torch.Tensor:
        """Predicted next features ``[1, T, h]`` of T new rows, appended to ``cache`` (slot 0).

        Args:
            embedded: ``[1, T, h]`` embeddings of tokens x_{j+1}.
            features: ``[1, T, h]`` features f_j (the target's through ``lift``, or the head's own predictions).
            cache: the head's cache; its length is the position of the first new row.
            parents: the rows of a draft tree, as ``Transformer.forward_rows`` takes them (the new rows
                last); None for consecutive rows.
        """
        t = embedded.shape[1]
        plan = plan_rows(cache, (0,), (t,), t, None if parents is None else [parents], None, self.device)
        x = self.fc(torch.cat((embedded, features), dim=-1))  # [1, T, h]
        x, _ = self.runner.run(x[0], cache, plan, (0,), ())
        cache.advance((0,), t)
        return x.to(self.dtype)[None]

    def forward(self, embedded: torch.Tensor, features: torch.Tensor, steps: int = 1) -> list[torch.Tensor]:
        """Training forward over whole sequences, no cache, drafting ``steps`` tokens from every row at once.

        Step 1 is row j on the target's feature f_j (seeing rows 0..j). Step s + 1 feeds row p the
        prediction step s made for position p (so row p there is the (s+1)-th token of a draft that left
        the target's features at row p - s) and lets it see what drafting would: the real rows up to
        p - s, and its own draft's rows of steps 2..s+1 (EAGLE-3's "training-time test").

        Args:
            embedded: ``[B, T, h]`` embeddings of tokens x_{j+1}.
            features: ``[B, T, F*h]`` the target's features f_j through ``normalize`` (training adds its
                noise there).
            steps: draft depth to train.

        Returns:
            Per step, predicted features ``[B, T, h]`` (row p: of position p + 1; rows p < step - 1 are
            meaningless and must be left out of the loss).
        """
        t = embedded.shape[1]
        cos_table, sin_table = self.rope.tables(t, self.dtype)  # [1, P, D]: one kind of layer
        cos, sin = cos_table[0, :t][None, :, None], sin_table[0, :t][None, :, None]  # [1, T, 1, D]
        features = self.project(features)
        outs, keys, values = [], [], []
        for step in range(steps):
            x = self.fc(torch.cat((embedded, features), dim=-1))
            q, k, v = self.block.qkv(x, cos, sin)  # [B, H, T, D], [B, Hkv, T, D]
            keys.append(k)
            values.append(v)
            if step == 0:
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.block.scale,
                                                      enable_gqa=q.shape[1] != k.shape[1])
            else:
                attn = _draft_attention(q, keys, values, self.block.scale)
            outs.append(self.block.finish(x, attn))
            features = F.pad(outs[-1][:, :-1], (0, 0, 1, 0))  # row p gets the prediction made at row p - 1
        return outs


def _draft_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                     scale: float) -> torch.Tensor:
    """Attention of draft step s = len(keys) - 1 (s >= 1): row p sees real rows 0..p - s (``keys[0]``) and,
    for t = 1..s, the row of step t at position p - (s - t) (its own draft's earlier tokens, itself last).

    Args:
        q: ``[B, H, T, D]`` this step's queries.
        keys: per step so far, ``[B, Hkv, T, D]`` (the last is this step's).
        values: same shapes as ``keys``.
        scale: what scores are multiplied by (the layer's).
    """
    s, (_, h, t, _) = len(keys) - 1, q.shape
    group = h // keys[0].shape[1]
    expand = lambda x: x.repeat_interleave(group, dim=1)  # noqa: E731 - [B, Hkv, T, D] -> [B, H, T, D]
    real = (q @ expand(keys[0]).transpose(-1, -2)) * scale  # [B, H, T, T]
    pos = torch.arange(t, device=q.device)
    real = real.masked_fill(pos[None, :] > pos[:, None] - s, float("-inf"))
    diag, diag_values = [], []
    for step in range(1, s + 1):
        shift = s - step  # this step's row p reads step `step`'s row p - shift
        k = F.pad(expand(keys[step]), (0, 0, shift, 0))[:, :, :t]
        diag.append(((q * k).sum(-1) * scale).masked_fill(pos < shift, float("-inf")))  # [B, H, T]
        diag_values.append(F.pad(expand(values[step]), (0, 0, shift, 0))[:, :, :t])
    probs = torch.cat((real, torch.stack(diag, dim=-1)), dim=-1).float().softmax(-1).to(q.dtype)  # [B, H, T, T + s]
    out = probs[..., :t] @ expand(values[0])
    for i, v in enumerate(diag_values):
        out = out + probs[..., t + i, None] * v
    return out
