"""From checkpoint tensors named as Hugging Face's Llama/Qwen2/Qwen3/Mistral/Gemma 3 models name them to our decoder's
parameters: q/k/v stacked into one projection, gate/up into another, a tied output head read from the
embedding table.

This module maps names and checks that nothing is missing; it does not read files (``loader.py``) or pack
weights (``packing.py``, which asks ``projection_parts`` where a packed projection's stored blocks are).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from specdecode.models.config import ModelConfig, expected_tensor_shapes


def projection_parts(layer: int) -> dict[str, list[str]]:
    """Each fused projection of layer ``layer`` and the checkpoint tensors (HF names, without ``.weight``)
    stacked into it, in order."""
    p = f"model.layers.{layer}."
    return {"wqkv": [f"{p}self_attn.{n}_proj" for n in "qkv"], "wo": [f"{p}self_attn.o_proj"],
            "w_gate_up": [f"{p}mlp.gate_proj", f"{p}mlp.up_proj"], "w_down": [f"{p}mlp.down_proj"]}


def head_part(config: ModelConfig) -> str:
    """The checkpoint tensor the output head computes with (the embedding table when tied)."""
    return "model.embed_tokens" if config.tie_word_embeddings else "lm_head"


def param_dtype(config: ModelConfig, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype parameter ``name`` of our model is kept in: ``dtype``, except Gemma's RMSNorm weights, kept in
    fp32. They hold 1 + w, and bf16's step near 1 (2^-7) would swallow most of a small w (HF keeps w itself in
    bf16 and adds the 1 in fp32; llama.cpp keeps the norms in f32)."""
    return torch.float32 if config.norm_offset and name.rsplit(".", 1)[-1].endswith("norm") else dtype


def hf_state_dict(config: ModelConfig, tensors: Mapping[str, torch.Tensor],
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our ``Transformer``'s state dict, in ``dtype``, from HF-named weights.

    Raises:
        ValueError: a tensor the architecture needs is missing (the first few are named).
    """
    missing = [n for n in expected_tensor_shapes(config) if n not in tensors]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    state = unpacked_state(config, lambda name, dt: tensors[name].to(dt), dtype)
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = tensors["lm_head.weight"]
    for i in range(config.num_layers):
        for name, parts in projection_parts(i).items():
            state[f"layers.{i}.{name}.weight"] = torch.cat([tensors[f"{p}.weight"] for p in parts])
        if config.attention_bias:
            state[f"layers.{i}.wqkv.bias"] = torch.cat([tensors[f"{p}.bias"] for p in projection_parts(i)["wqkv"]])
    return {k: v.to(param_dtype(config, k, dtype)) for k, v in state.items()}


def unpacked_state(config: ModelConfig, read: Callable[[str, torch.dtype], torch.Tensor],
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The parameters that packing leaves as they are (the embedding table and the RMSNorm weights, Qwen3's
    per-head query/key norms and Gemma's post-norms included), each ``read(checkpoint name, its dtype)``
    (``param_dtype``: ``dtype``, or fp32 for Gemma's norms); the projections and the output head are
    ``packing.py``'s."""
    names = {"embed.weight": "model.embed_tokens.weight", "norm": "model.norm.weight"}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names[f"layers.{i}.attn_norm"] = f"{p}input_layernorm.weight"
        if config.sandwich_norms:  # Gemma: post_attention_layernorm follows attention, a fourth norm the MLP
            names[f"layers.{i}.post_attn_norm"] = f"{p}post_attention_layernorm.weight"
            names[f"layers.{i}.mlp_norm"] = f"{p}pre_feedforward_layernorm.weight"
            names[f"layers.{i}.post_mlp_norm"] = f"{p}post_feedforward_layernorm.weight"
        else:
            names[f"layers.{i}.mlp_norm"] = f"{p}post_attention_layernorm.weight"
        if config.qk_norm:
            names[f"layers.{i}.q_norm"] = f"{p}self_attn.q_norm.weight"
            names[f"layers.{i}.k_norm"] = f"{p}self_attn.k_norm.weight"
    return {ours: read(theirs, param_dtype(config, ours, dtype)) for ours, theirs in names.items()}
