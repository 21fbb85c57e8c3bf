"""Tiny random-weight models for tests that need no download."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from specdecode.drafters.base import Draft, DrafterBase
from specdecode.models.build import from_hf_tensors
from specdecode.models.config import ModelConfig, expected_tensor_shapes, gemma3_fields
from specdecode.models.transformer import Transformer


def tiny_config(arch: str = "llama", **overrides) -> ModelConfig:
    """A 2-4 layer model small enough to run hundreds of forwards per second (Gemma 3: a window of 8 on three
    of its four layers, their own RoPE base, and a query scale that is not head_dim's)."""
    if arch == "gemma3":
        gemma = gemma3_fields(overrides.get("hidden_size", 64), (True, True, False, True), query_pre_attn_scalar=24)
        overrides = {**gemma, "sliding_window": 8, "rope_theta": 1e6, "tie_word_embeddings": True,
                     "rms_norm_eps": 1e-6, **overrides}
    fields = dict(arch=arch, vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=arch == "llama", attention_bias=arch == "qwen2", max_position_embeddings=512)
    fields.update(overrides)
    return ModelConfig(**fields)


# Draw order of the random weights (kept stable so that seeded tiny models stay the same models).
_GLOBAL = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
_PER_LAYER = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight",
              "down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight", "q_proj.bias",
              "k_proj.bias", "v_proj.bias", "q_norm.weight", "k_norm.weight", "pre_feedforward_layernorm.weight",
              "post_feedforward_layernorm.weight")


def _draw_rank(name: str) -> tuple[int, int]:
    if name in _GLOBAL:
        return -1, _GLOBAL.index(name)
    layer = int(name.split(".")[2])
    return layer, next(i for i, leaf in enumerate(_PER_LAYER) if name.endswith(leaf))


def random_hf_tensors(config: ModelConfig, seed: int = 0, scale: float = 0.08) -> dict[str, torch.Tensor]:
    """HF-named float32 weights drawn from N(0, scale); norms near 1 so activations stay sane."""
    g = torch.Generator().manual_seed(seed)
    shapes = expected_tensor_shapes(config)
    out = {}
    for name in sorted(shapes, key=_draw_rank):
        base = 1.0 if "norm" in name else 0.0
        boost = 4.0 if "embed" in name else 1.0
        out[name] = base + scale * torch.randn(shapes[name], generator=g) * boost
    return out


def tiny_model(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Transformer:
    config = tiny_config(arch, **overrides)
    return from_hf_tensors(config, random_hf_tensors(config, seed), dtype=dtype)


WORDS = ("the a cat dog sat on mat and ran to park big small red blue green one two three four five six "
         "seven eight nine ten is was were be it this that what why how who when where write code def return "
         "if else for in print list dict sum add sort text word short long summary translate french german "
         "answer question passage math plus minus times equal number prime function python function_name "
         "value key loop while true false none yes no good bad happy sad fast slow up down left right day "
         "night sun moon star tree house car road city town river sea sky").split()


def write_tiny_hf_model(folder: Path, seed: int = 0, arch: str = "llama", words: Sequence[str] = WORDS) -> Path:
    """A tiny random-weight HF folder that `load_model` and the CLI accept.

    config.json + model.safetensors + tokenizer.json (WordLevel over ``words``, whitespace pre-tokenizer)
    + tokenizer_config.json (eos ``<eos>``, no chat template). Folders written with the same ``words``
    share a vocabulary; other ``words`` give a draft/target vocabulary mismatch.
    """
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = tiny_config(arch)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config.to_hf()))
    tensors = random_hf_tensors(config, seed=seed)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    vocab = {"<eos>": 0, "[UNK]": 1}
    for w in dict.fromkeys(words):
        if len(vocab) < config.vocab_size:
            vocab[w] = len(vocab)
    assert len(vocab) <= config.vocab_size
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return folder


def varied_model(seed: int = 0, keep_layers: list[int] | None = None, num_layers: int = 4,
                 dtype: torch.dtype = torch.float32, arch: str = "llama") -> Transformer:
    """A tiny llama (or ``arch``) with weights at scale 0.2 (greedy continuations vary; at tiny_model's default
    scale they repeat one token); with ``keep_layers``, seed's llama truncated to those layers: a different
    model that often agrees with it (a natural draft)."""
    config = tiny_config(arch, num_layers=num_layers)
    tensors = random_hf_tensors(config, seed, scale=0.2)
    if keep_layers is not None and arch != "llama":
        raise ValueError("varied_model: keep_layers makes llama drafts only")
    if keep_layers is None:
        return from_hf_tensors(config, tensors, dtype=dtype)
    kept = {k: v for k, v in tensors.items() if not k.startswith("model.layers.")}
    for j, i in enumerate(keep_layers):
        prefix = f"model.layers.{i}."
        kept.update({f"model.layers.{j}." + k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
    return from_hf_tensors(tiny_config("llama", num_layers=len(keep_layers)), kept, dtype=dtype)



def random_head(kind: str, target: Transformer, seed: int = 0, medusa_heads: int = 3, scale: float = 0.1,
                fuse_layers: Sequence[int] = ()):
    """An untrained EAGLE or Medusa head shaped for ``target``, float32, weights drawn from N(0, scale);
    an EAGLE head reading ``fuse_layers`` of the target (EAGLE-3) where given."""
    from specdecode.heads import new_head
    from specdecode.heads.eagle import EagleConfig
    from specdecode.heads.medusa import MedusaConfig

    config = (EagleConfig.for_target(target.config, fuse_layers) if kind == "eagle"
              else MedusaConfig(target.config.hidden_size, medusa_heads)).to_dict()
    net = new_head(kind, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn(p.shape, generator=g))
    return net, config


def random_head_drafter(kind: str, target: Transformer, vocab: Sequence[int] | None = None, seed: int = 0, cache=None):
    """A drafter over a random head (``vocab``: the draft vocabulary, default all ids), ready for an Engine;
    kind "eagle-tree" drafts trees two wide, "eagle3" reads three of the target's layers (EAGLE-3)."""
    from specdecode.drafters import EagleDrafter, MedusaDrafter
    from specdecode.heads.eagle import eagle3_layers
    from specdecode.heads.vocab import VocabHead
    from specdecode.kv.cache import CacheConfig

    fuse = eagle3_layers(target.config.num_layers) if kind == "eagle3" else ()
    net, _ = random_head("eagle" if kind == "eagle3" else kind.removesuffix("-tree"), target, seed, fuse_layers=fuse)
    net = net.to(target.dtype).eval().requires_grad_(False)
    ids = torch.tensor(list(vocab) if vocab is not None else range(target.config.vocab_size))
    if kind in ("eagle", "eagle-tree", "eagle3"):
        net.pack_like(target)
        return EagleDrafter(target, net, VocabHead(target, ids), cache or CacheConfig(), 2 if kind == "eagle-tree" else 0)
    return MedusaDrafter(target, net, VocabHead(target, ids))


def write_head_file(path: Path, kind: str, target: Transformer, vocab: Sequence[int] | None = None, seed: int = 0) -> Path:
    """A head file with a random head for ``target``."""
    from specdecode.heads.file import HeadFile, save_head, target_identity

    net, config = random_head(kind, target, seed)
    first = list(vocab) if vocab is not None else []
    ranking = torch.tensor(first + [i for i in range(target.config.vocab_size) if i not in first])  # vocab ranked first
    save_head(path, HeadFile(kind, config, target_identity(target, "tiny"), {"test": True}, net.state_dict(), ranking,
                             len(first)))
    return path


class OracleTreeDrafter(DrafterBase):
    """A tree drafter that knows the answer (test helper): every draft puts a wrong token first at the root
    (and, given 5 nodes, at the second level) and the known continuation on the second branch, so that each
    accepted path leaves the first branch and the cache must move it into place.

    Args:
        answers: prompt (as a tuple) -> the tokens plain decoding generates after it.
        vocab: the target's vocabulary size (wrong tokens are the right ones plus one).
    """

    name, signal_names = "oracle-tree", ()

    def __init__(self, answers: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.answers, self.vocab, self.prompt = answers, vocab, ()

    def reset(self, target_cache, prompt=(), memory=None, slot=0) -> None:
        self.prompt = tuple(prompt)

    def propose(self, seq, k, sampling, generator, stop=None):
        right = self.answers[self.prompt][len(seq) - len(self.prompt):][:3]
        wrong = [(t + 1) % self.vocab for t in right]
        if k >= 5 and len(right) == 3:  # root: wrong, right[0]; under right[0]: wrong, right[1]; then right[2]
            return Draft([wrong[0], right[0], wrong[1], right[1], right[2]], parents=[-1, -1, 1, 1, 3])
        if k >= 3 and len(right) >= 2:  # compressed caches allow short drafts: root: wrong, right[0]; right[1]
            return Draft([wrong[0], right[0], right[1]], parents=[-1, -1, 1])
        if k == 2 and right:
            return Draft([wrong[0], right[0]], parents=[-1, -1])
        return Draft([])

    def commit(self, seq) -> None:
        pass
