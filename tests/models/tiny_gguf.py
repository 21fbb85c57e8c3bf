"""Writes tiny GGUF files the way llama.cpp's converter does, for loader and tokenizer tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import quantize

from specdecode.models.config import ModelConfig, gemma3_fields, gemma3_window_layers
from specdecode.models.loader import expected_tensor_shapes

# Merges of the tiny vocabulary, best first; each also adds its result as a token.
MERGES = ["Ġ t", "h e", "Ġt he", "1 2", "i n"]
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<tool_call>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
# Gemma's four norms per layer (llama.cpp's ffn_norm is the pre-MLP one)
_SANDWICH_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm",
                   "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def byte_tokens() -> list[str]:
    """GPT-2's 256 byte characters, in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def tokenizer_metadata(pre: str = "gpt2", add_bos: bool = False) -> dict:
    """GGUF ``tokenizer.*`` metadata of a 265-token byte-level BPE vocabulary."""
    tokens = byte_tokens() + [m.replace(" ", "") for m in MERGES] + CONTROL + USER_DEFINED
    types = [1] * (len(tokens) - len(CONTROL) - len(USER_DEFINED)) + [3] * len(CONTROL) + [4] * len(USER_DEFINED)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": tokens.index("<|im_start|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.add_bos_token": add_bos,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


VOCAB_SIZE = len(tokenizer_metadata()["tokenizer.ggml.tokens"])


def tiny_config(arch: str = "llama", **overrides) -> ModelConfig:
    """A 2-layer model over the tiny vocabulary; ``overrides`` replace ModelConfig fields. Gemma 3: 6 layers as a
    Gemma 3 GGUF implies them (window 8 on all but the last, their RoPE base 10000)."""
    if arch == "gemma3":  # as the GGUF loader reads a Gemma 3 (every sixth layer full, query scale head_dim's)
        gemma = gemma3_fields(overrides.get("hidden_size", 64), gemma3_window_layers(6), overrides.get("head_dim", 16))
        overrides = {**gemma, "num_layers": 6, "sliding_window": 8, "rope_theta": 1e6, "tie_word_embeddings": True,
                     "rms_norm_eps": 1e-6, **overrides}
    fields = dict(arch=arch, vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=arch == "llama", attention_bias=arch == "qwen2", max_position_embeddings=256)
    fields.update(overrides)
    return ModelConfig(**fields)


def random_tensors(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """N(0, 1) float32 weights for every tensor ``config`` needs, under HF names."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in expected_tensor_shapes(config).items()}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, verbatim."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str, sandwich_norms: bool = False) -> str:
    """llama.cpp's name for a HF tensor name (``sandwich_norms``: Gemma's four norms per layer)."""
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{(_SANDWICH_LAYER if sandwich_norms else _LAYER)[module]}.{kind}"


K_QUANT_BYTES = {gguf.GGMLQuantizationType.Q4_K: (144, [0, 2]), gguf.GGMLQuantizationType.Q5_K: (176, [0, 2]),
                 gguf.GGMLQuantizationType.Q6_K: (210, [208])}


def k_quant_blocks(qtype: gguf.GGMLQuantizationType, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """Random well-formed ``qtype`` blocks (K-quant) for a ``shape`` matrix: uint8 ``[rows, row bytes]``, with
    small finite fp16 scales (the fields at the listed byte offsets of each 256-weight super-block)."""
    size, halves = K_QUANT_BYTES[qtype]
    rows, k = shape
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * k // 256, size), dtype=np.uint8)
    for at in halves:
        raw[:, at:at + 2] = (rng.random(len(raw)) * 0.02).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def write_gguf(path: Path, config: ModelConfig, tensors: dict[str, torch.Tensor],
               qtypes: dict[str, gguf.GGMLQuantizationType] | None = None, arch: str | None = None,
               metadata: dict | None = None, extra: dict[str, np.ndarray] | None = None) -> Path:
    """Writes ``tensors`` (HF names) as llama.cpp would: GGUF names, Llama Q/K permuted, optional quantization
    (Q4_K and Q6_K tensors get random blocks, not the tensor's values); ``extra`` float32 tensors under their
    GGUF names (``rope_freqs.weight``)."""
    arch = arch or config.arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_key_length(config.head_dim)
    w.add_rope_dimension_count(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    if config.sliding_window is not None:
        w.add_sliding_window(config.sliding_window)
    meta = {**tokenizer_metadata(), **(metadata or {})}
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])
    w.add_chat_template(meta["tokenizer.chat_template"])
    for name, tensor in tensors.items():
        data = tensor.numpy()
        if config.arch == "llama" and ".q_proj." in name:
            data = llama_cpp_permute(data, config.num_heads)
        elif config.arch == "llama" and ".k_proj." in name:
            data = llama_cpp_permute(data, config.num_kv_heads)
        qtype = (qtypes or {}).get(name)
        if qtype is None:
            w.add_tensor(gguf_name(name, config.sandwich_norms), np.ascontiguousarray(data, dtype=np.float32))
        elif qtype in K_QUANT_BYTES:  # the gguf package cannot encode these: random well-formed blocks instead
            w.add_tensor(gguf_name(name, config.sandwich_norms), k_quant_blocks(qtype, data.shape, seed=len(name)), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name, config.sandwich_norms), quantize(data, qtype), raw_dtype=qtype)
    for name, data in (extra or {}).items():
        w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
