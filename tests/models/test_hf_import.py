"""Checkpoint names to our parameters (``hf_import.py``): fused projections stacked in order, missing tensors named."""

from __future__ import annotations

import pytest
import torch

from specdecode.models.build import from_hf_tensors
from specdecode.models.hf_import import head_part, hf_state_dict, projection_parts
from tiny_models import random_hf_tensors, tiny_config


def test_fused_projections_stack_their_parts_in_order():
    config = tiny_config("qwen2")
    tensors = random_hf_tensors(config)
    state = hf_state_dict(config, tensors, torch.bfloat16)
    q, k, v = (tensors[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(state["layers.1.wqkv.weight"], torch.cat([q, k, v]).bfloat16())
    assert torch.equal(state["layers.1.wqkv.bias"],
                       torch.cat([tensors[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv"]).bfloat16())
    assert projection_parts(1)["w_gate_up"] == ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]
    assert head_part(config) == "lm_head" and head_part(tiny_config("llama")) == "model.embed_tokens"
    assert all(t.dtype == torch.bfloat16 for t in state.values())


def test_missing_tensor_is_named():
    config = tiny_config("qwen2")
    tensors = random_hf_tensors(config)
    del tensors["model.layers.2.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*model\.layers\.2\.mlp\.up_proj\.weight"):
        from_hf_tensors(config, tensors)


def test_untied_model_needs_lm_head():
    config = tiny_config("llama", tie_word_embeddings=False)
    tensors = random_hf_tensors(tiny_config("llama", tie_word_embeddings=True))
    with pytest.raises(ValueError, match="lm_head.weight"):
        from_hf_tensors(config, tensors)
