"""Tiny random-weight models for tests that need no download."""

from __future__ import annotations

import torch

from specdecode.models.config import ModelConfig
from specdecode.models.transformer import Transformer, _expected_names


def tiny_config(arch: str = "llama", **overrides) -> ModelConfig:
    """A 2-4 layer model small enough to run hundreds of forwards per second."""
    fields = dict(arch=arch, vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=arch == "llama", attention_bias=arch == "qwen2", max_position_embeddings=512)
    fields.update(overrides)
    return ModelConfig(**fields)


def random_hf_tensors(config: ModelConfig, seed: int = 0, scale: float = 0.08) -> dict[str, torch.Tensor]:
    """HF-named float32 weights drawn from N(0, scale); norms near 1 so activations stay sane."""
    g = torch.Generator().manual_seed(seed)
    c = config
    shapes = {"q_proj": (c.num_heads * c.head_dim, c.hidden_size), "k_proj": (c.num_kv_heads * c.head_dim, c.hidden_size),
              "v_proj": (c.num_kv_heads * c.head_dim, c.hidden_size), "o_proj": (c.hidden_size, c.num_heads * c.head_dim),
              "gate_proj": (c.intermediate_size, c.hidden_size), "up_proj": (c.intermediate_size, c.hidden_size),
              "down_proj": (c.hidden_size, c.intermediate_size)}
    out = {}
    for name in _expected_names(config):
        leaf = name.split(".")[-2]
        if name.endswith("norm.weight") or "layernorm" in name:
            shape, base = (c.hidden_size,), 1.0
        elif name.endswith(".bias"):
            shape, base = (shapes[leaf][0],), 0.0
        elif leaf in shapes:
            shape, base = shapes[leaf], 0.0
        else:  # embed_tokens, lm_head
            shape, base = (c.vocab_size, c.hidden_size), 0.0
        out[name] = base + scale * torch.randn(shape, generator=g) * (4.0 if base == 0.0 and "embed" in name else 1.0)
    return out


def tiny_model(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Transformer:
    config = tiny_config(arch, **overrides)
    return Transformer.from_hf_tensors(config, random_hf_tensors(config, seed), dtype=dtype)
