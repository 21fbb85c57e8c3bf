"""Architecture description of a Llama/Qwen2/Qwen3/Mistral-family decoder.

One dataclass that every loader (GGUF, HF folder, hub id) fills in and the decoder in
`transformer.py` reads. It does not hold weights or tokenizer data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer.

    Args:
        arch: family name, one of SUPPORTED_ARCHITECTURES.
        vocab_size: rows of the embedding and of the output head.
        hidden_size: model width.
        intermediate_size: SwiGLU inner width.
        num_layers: decoder blocks.
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA when fewer than num_heads).
        head_dim: width of one head.
        rope_theta: RoPE base frequency.
        rope_scaling: HF-style scaling dict (``rope_type`` linear or llama3) or None; a GGUF's per-frequency
            divisors (``rope_freqs.weight``) as ``{"rope_type": "freq_factors", "factors": [...]}``.
        rms_norm_eps: epsilon of every RMSNorm.
        tie_word_embeddings: output head shares the embedding matrix.
        attention_bias: q/k/v projections carry a bias (Qwen2).
        max_position_embeddings: longest context the model was trained for.
        sliding_window: Mistral's attention window, or None for full attention.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None

    @property
    def qk_norm(self) -> bool:
        """Queries and keys get a per-head RMSNorm before RoPE (Qwen3's ``q_norm`` / ``k_norm``)."""
        return self.arch == "qwen3"

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"ModelConfig.arch={self.arch!r} is not supported; expected one of {SUPPORTED_ARCHITECTURES}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Builds a config from a HF ``config.json`` dictionary."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json model_type={model_type!r} is not supported; expected one of {SUPPORTED_ARCHITECTURES}"
            )
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", rope.get("type", "default")) != "default":
            # transformers >= 5 writes the scaling into rope_parameters (next to rope_theta), not rope_scaling.
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        return cls(
            arch=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None,
        )

    def to_hf(self) -> dict[str, Any]:
        """The inverse of :meth:`from_hf`, for writing a ``config.json`` (used by tests and parity checks)."""
        return {
            "model_type": self.arch,
            "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.arch]],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "hidden_act": "silu",
        }


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``config`` must provide, with its shape, under HF names.

    Args:
        config: the architecture.
    """
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "self_attn.q_proj.weight": (q, c.hidden_size),
            p + "self_attn.k_proj.weight": (kv, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, q),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        })
        if c.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if c.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)})
    return shapes
