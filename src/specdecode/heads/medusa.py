"""Medusa-style draft heads: k residual blocks on the target's last feature, one per future position.

Head i maps the target's feature f_j (its normed final state at position j) to ``f_j + SiLU(W_i f_j +
b_i)``, which the target's output head (restricted to a draft vocabulary) scores as a guess of token
x_{j+2+i}: the target's own head already gives x_{j+1}. Head i never sees the tokens guessed before
position i, which is why Medusa drafts are weaker than EAGLE's. W_i starts at zero, so an untrained head
repeats the target's own next-token guess.

This module holds the network only; drafting is ``drafters/medusa.py`` (with the lossless rule, never
Medusa's "typical acceptance"), training ``train.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MedusaConfig:
    """``heads`` residual blocks of width ``hidden_size``."""

    hidden_size: int
    heads: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.heads <= 16:
            raise ValueError(f"MedusaConfig.heads must be in 1..16, got {self.heads}")

    def to_dict(self) -> dict[str, Any]:
        return {"hidden_size": self.hidden_size, "heads": self.heads}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MedusaConfig":
        return cls(int(data["hidden_size"]), int(data["heads"]))


class MedusaHeads(nn.Module):
    """All heads' weights in one ``[heads, h, h]`` tensor, so that one batched matmul runs them all.

    Args:
        config: the architecture.
    """

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.head_config = config
        h = config.hidden_size
        self.weight = nn.Parameter(torch.zeros(config.heads, h, h))  # [heads, out, in]
        self.bias = nn.Parameter(torch.zeros(config.heads, h))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``[..., h]`` features -> ``[..., heads, h]``, head i's state for the token i + 2 ahead."""
        x = features.unsqueeze(-2)  # [..., 1, h]
        return x + F.silu(torch.einsum("...ki,khi->...kh", x.expand(*x.shape[:-2], self.head_config.heads, -1),
                                       self.weight) + self.bias)
