"""Architecture description of a Llama/Qwen2/Qwen3/Mistral/Gemma 3-family decoder.

One dataclass that every loader (GGUF, HF folder, hub id) fills in and the decoder in
`transformer.py` reads. It does not hold weights or tokenizer data.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
_HF_MODEL_TYPES = {"gemma3_text": "gemma3"}  # HF's name of a text-only Gemma 3 -> ours
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # Gemma 3's windowed layers (llama.cpp hard-codes it too; GGUF has no key)


class Activation(enum.IntEnum):
    """The MLP's gate activation; the value is what the fused kernel (``kernels/layer.h``) is told."""

    SILU = 0  # SwiGLU: Llama, Qwen, Mistral
    GELU_TANH = 1  # GeGLU with tanh-approximated GELU: Gemma


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
        sliding_window: the attention window (Mistral's, Gemma 3's local layers'), or None for full attention.
        window_layers: which layers the window applies to (Gemma 3 interleaves windowed and full layers); None:
            all of them.
        local_rope_theta: RoPE base of the windowed layers, which rotate unscaled (Gemma 3's local layers), or
            None: every layer rotates as ``rope_theta`` and ``rope_scaling`` say.
        activation: the MLP's gate activation.
        sandwich_norms: an RMSNorm also after attention and after the MLP, before each residual add (Gemma 3).
        embed_scale: the embedding rows are multiplied by it (Gemma: sqrt(hidden_size)).
        query_scale: attention's score scale (Gemma 3: ``query_pre_attn_scalar ** -0.5``); None: head_dim ** -0.5.
        norm_offset: HF checkpoints store RMSNorm weights minus this (Gemma's ``x * (1 + w)``); ``load_hf_dir``
            adds it, so a checkpoint's norm weights are the factors themselves (as GGUF files store them) by the
            time ``build.from_hf_tensors`` or ``build.packed_from`` reads them.
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
    window_layers: tuple[bool, ...] | None = None
    local_rope_theta: float | None = None
    activation: Activation = Activation.SILU
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    query_scale: float | None = None
    norm_offset: float = 0.0

    @property
    def qk_norm(self) -> bool:
        """Queries and keys get a per-head RMSNorm before RoPE (Qwen3's and Gemma 3's ``q_norm`` / ``k_norm``)."""
        return self.arch in ("qwen3", "gemma3")

    def window_of(self, layer: int) -> int | None:
        """The attention window of layer ``layer``, or None where it attends to every earlier token."""
        if self.window_layers is not None and not self.window_layers[layer]:
            return None
        return self.sliding_window

    @property
    def mixed_windows(self) -> bool:
        """Its layers attend over different windows (Gemma 3), so one key index cannot serve them all."""
        return len({self.window_of(i) for i in range(self.num_layers)}) > 1

    def local_rope(self, layer: int) -> bool:
        """Layer ``layer`` rotates at the windowed layers' own base, unscaled (Gemma 3's local layers)."""
        return self.local_rope_theta is not None and self.window_of(layer) is not None

    def rope_theta_of(self, layer: int) -> float:
        """The RoPE base of layer ``layer``."""
        return self.local_rope_theta if self.local_rope(layer) else self.rope_theta

    @property
    def attention_scale(self) -> float:
        """What attention scores are multiplied by."""
        return self.head_dim ** -0.5 if self.query_scale is None else self.query_scale

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
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"ModelConfig.sliding_window must be >= 1 (or None), got {self.sliding_window}")
        if self.window_layers is not None and len(self.window_layers) != self.num_layers:
            raise ValueError(f"ModelConfig.window_layers has {len(self.window_layers)} entries for "
                             f"{self.num_layers} layers")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Builds a config from a HF ``config.json`` dictionary."""
        model_type = cfg.get("model_type", "llama")
        if model_type == "gemma3":  # transformers' multimodal Gemma 3 (text_config + vision_config)
            raise ValueError("config.json model_type='gemma3' is the multimodal Gemma 3; only its text-only form "
                             "(model_type 'gemma3_text', Gemma3ForCausalLM) is supported")
        model_type = _HF_MODEL_TYPES.get(model_type, model_type)
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json model_type={model_type!r} is not supported; expected one of {SUPPORTED_ARCHITECTURES}"
            )
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        local_rope = None
        if model_type == "gemma3":  # transformers >= 5: one rope_parameters entry per kind of layer
            local_rope = rope.get("sliding_attention", {}).get("rope_theta", cfg.get("rope_local_base_freq"))
            rope = rope.get("full_attention", rope)
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", rope.get("type", "default")) != "default":
            # transformers >= 5 writes the scaling into rope_parameters (next to rope_theta), not rope_scaling.
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        gemma = _gemma3_fields(cfg, local_rope) if model_type == "gemma3" else {}
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
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type == "gemma3")),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            sliding_window=cfg.get("sliding_window")
            if cfg.get("use_sliding_window", model_type in ("mistral", "gemma3")) else None,
            **gemma,
        )

    def to_hf(self) -> dict[str, Any]:
        """The inverse of :meth:`from_hf`, for writing a ``config.json`` (used by tests and parity checks)."""
        common = {
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
        }
        if self.arch == "gemma3":  # transformers' Gemma3TextConfig
            return {
                "model_type": "gemma3_text",
                "architectures": ["Gemma3ForCausalLM"],
                **common,
                "rope_local_base_freq": self.local_rope_theta,
                "layer_types": ["sliding_attention" if self.window_of(i) else "full_attention"
                                for i in range(self.num_layers)],
                "query_pre_attn_scalar": round(self.attention_scale ** -2),
                "hidden_activation": "gelu_pytorch_tanh",
                "final_logit_softcapping": None,
                "attn_logit_softcapping": None,
            }
        return {
            "model_type": self.arch,
            "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.arch]],
            **common,
            "use_sliding_window": self.sliding_window is not None,
            "hidden_act": "silu",
        }


def gemma3_fields(hidden_size: int, window_layers: tuple[bool, ...], query_pre_attn_scalar: float,
                  local_rope_theta: float | None = None) -> dict[str, Any]:
    """The ModelConfig fields that make a Gemma 3 beyond the Llama ones, whichever file they come from.

    Args:
        hidden_size: the model width (the embedding scale is its square root).
        window_layers: which layers attend within the sliding window.
        query_pre_attn_scalar: attention scores are scaled by its inverse square root.
        local_rope_theta: the windowed layers' RoPE base (None: Gemma 3's 10000).
    """
    return {
        "window_layers": window_layers,
        "local_rope_theta": GEMMA3_LOCAL_ROPE_THETA if local_rope_theta is None else float(local_rope_theta),
        "activation": Activation.GELU_TANH,
        "sandwich_norms": True,
        "embed_scale": math.sqrt(hidden_size),
        "query_scale": float(query_pre_attn_scalar) ** -0.5,
        "norm_offset": 1.0,
    }


def gemma3_window_layers(num_layers: int, pattern: int = 6) -> tuple[bool, ...]:
    """Gemma 3's interleaving: every ``pattern``-th layer attends to the whole context, the others within the window."""
    return tuple((i + 1) % pattern != 0 for i in range(num_layers))


def _gemma3_fields(cfg: dict[str, Any], local_rope_theta: float | None) -> dict[str, Any]:
    """What a Gemma 3 ``config.json`` sets beyond the Llama fields."""
    if cfg.get("final_logit_softcapping") or cfg.get("attn_logit_softcapping"):
        raise ValueError("Gemma logit soft-capping (final_logit_softcapping / attn_logit_softcapping) is not supported")
    act = cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma 3 hidden_activation={act!r} is not supported (only gelu_pytorch_tanh)")
    layers, types = cfg["num_hidden_layers"], cfg.get("layer_types")
    windows = gemma3_window_layers(layers, int(cfg.get("sliding_window_pattern", 6))) if types is None else \
        tuple(t == "sliding_attention" for t in types)  # older configs give the pattern, newer ones each layer
    return gemma3_fields(cfg["hidden_size"], windows, cfg.get("query_pre_attn_scalar", cfg.get("head_dim", 256)),
                         local_rope_theta)


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
        if c.sandwich_norms:
            shapes.update({p + "pre_feedforward_layernorm.weight": (c.hidden_size,),
                           p + "post_feedforward_layernorm.weight": (c.hidden_size,)})
    return shapes
