"""Load checkpoint weights, config and tokenizer from a registry name, a GGUF file, a HF folder or a hub id.

Every source ends as the same thing: a `ModelConfig`, float32 CPU tensors under Hugging Face names, and
a `Tokenizer`. A GGUF file's header is read by `gguf.py`; here its names and config are mapped, and its
tensors are read one at a time when the model is built (`GGUFTensors`: as floats, or as blocks for the
packer), with llama.cpp's rotary permutation of Llama Q/K undone. This module does not build or run the
model (see `transformer.py`) and does not write anything except through `fetch.py` and the tokenizer cache.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdecode.models import registry
from specdecode.models.config import ModelConfig, expected_tensor_shapes, gemma3_fields, gemma3_window_layers
from specdecode.models.fetch import fetch
# GGUFError and LoadError are raised through this module too: importers find them here.
from specdecode.models.gguf import GGUFError, GGUFFile, GGUFTensorInfo, LoadError, read_gguf, read_gguf_raw  # noqa: F401
from specdecode.models.tokenizer import Tokenizer
from specdecode.models.weights import FORMAT_OF, Blocks, WeightSource, convert, dequantized

Progress = Callable[[str], None]

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
ROPE_FACTORS = "rope_freqs.weight"  # a config value stored as a tensor, not a weight


@dataclass
class Checkpoint:
    """Everything the decoder needs, independent of where it came from.

    Args:
        config: the architecture.
        tensors: float32 CPU tensors with HF names (``model.layers.0.self_attn.q_proj.weight`` ...);
            no ``lm_head.weight`` when embeddings are tied. A GGUF file's are read when asked for
            (``GGUFTensors``): each access reads the file again.
        tokenizer: the tokenizer, with chat template when the checkpoint has one.
        source: the file or folder the weights were read from.
        stored: the formats the file stores its weights in and readers of each tensor as blocks or in a
            dtype, one at a time (GGUF); None for float checkpoints.
        file: the GGUF file (what a packed model on disk is keyed by); None for folders.
    """

    config: ModelConfig
    tensors: Mapping[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str
    stored: WeightSource | None = None
    file: Path | None = None

    @property
    def weights(self) -> WeightSource:
        """What ``packing.pack`` reads: the float tensors, and the stored blocks where there are some."""
        return self.stored or WeightSource(self.tensors)


# ----------------------------------------------------------------------------------------------
# GGUF -> HF names and config

_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma's four norms: llama.cpp's ffn_norm is its pre-MLP norm, as elsewhere, but HF names that one differently.
_GGUF_SANDWICH_BLOCK = {**_GGUF_BLOCK, "ffn_norm": "pre_feedforward_layernorm",
                        "post_attention_norm": "post_attention_layernorm",
                        "post_ffw_norm": "post_feedforward_layernorm"}
_GGUF_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, sandwich_norms: bool = False) -> str | None:
    """The HF name of a llama.cpp tensor name, or None when it has no HF counterpart here.

    Args:
        gguf_name: the tensor's name in the GGUF file.
        sandwich_norms: the model has Gemma's four norms per layer (``ModelConfig.sandwich_norms``).
    """
    if gguf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[gguf_name]
    block = _GGUF_SANDWICH_BLOCK if sandwich_norms else _GGUF_BLOCK
    m = _GGUF_BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in block:
        return f"model.layers.{m.group(1)}.{block[m.group(2)]}.{m.group(3)}"
    return None


def _f32(value: float) -> float:
    # GGUF stores float32; its shortest repr is the config's original value (1e-05, not 9.99999974e-06).
    return float(str(np.float32(value)))


def gguf_config(gguf: GGUFFile) -> ModelConfig:
    """Builds a ModelConfig from the ``{arch}.*`` metadata and the tensor directory of a GGUF file.

    Args:
        gguf: a parsed GGUF header.

    Raises:
        LoadError: unsupported architecture, missing keys, or a feature the decoder lacks.
    """
    meta, path = gguf.metadata, gguf.path
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise LoadError(f"{path}: GGUF architecture {arch!r} is not supported; expected one of {GGUF_ARCHITECTURES}")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise LoadError(f"{path}: GGUF metadata lacks {arch}.{name}")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rotary = int(key("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise LoadError(f"{path}: partial rotary embeddings ({rotary} of {head_dim} dims) are not supported")
    rope_scaling = _gguf_rope_scaling(gguf, arch, key, head_dim)
    embd = gguf.tensors.get("token_embd.weight")
    if embd is None:
        raise LoadError(f"{path}: GGUF file has no token_embd.weight tensor")
    window = meta.get(f"{arch}.attention.sliding_window") if arch == "gemma3" else None  # as llama.cpp reads it
    gemma = _gemma3_gguf_fields(int(key("block_count")), hidden, heads, head_dim) if arch == "gemma3" else {}
    return ModelConfig(
        arch=arch,
        vocab_size=embd.shape[0],
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=_f32(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in gguf.tensors,
        max_position_embeddings=int(key("context_length")),
        sliding_window=int(window) if window else None,  # 0: no window
        **gemma,
    )


def _gguf_rope_scaling(gguf: GGUFFile, arch: str, key: Callable[..., Any], head_dim: int) -> dict[str, Any] | None:
    """The ``rope_scaling`` of a GGUF file: its ``{arch}.rope.scaling.*`` keys, or Llama 3.x's frequency factors
    tensor, or None (``key`` reads a required ``{arch}.*`` key)."""
    meta, path = gguf.metadata, gguf.path
    rope_scaling = None
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type != "none":
        rope_scaling = {"rope_type": scaling_type, "factor": _f32(key("rope.scaling.factor"))}
        if f"{arch}.rope.scaling.original_context_length" in meta:
            rope_scaling["original_max_position_embeddings"] = int(meta[f"{arch}.rope.scaling.original_context_length"])
    if ROPE_FACTORS in gguf.tensors:  # Llama 3.x: llama.cpp stores the scaled frequencies' divisors as a tensor
        if rope_scaling is not None:
            raise LoadError(f"{path}: {ROPE_FACTORS} together with rope scaling {scaling_type!r} is not supported")
        factors = gguf.tensors[ROPE_FACTORS]
        if factors.shape != (head_dim // 2,):
            raise LoadError(f"{path}: {ROPE_FACTORS} has shape {factors.shape}, expected ({head_dim // 2},)")
        with open(path, "rb") as f:
            values = dequantized(read_gguf_raw(f, factors), factors.qtype, factors.shape)
        rope_scaling = {"rope_type": "freq_factors", "factors": [float(v) for v in values]}
    return rope_scaling


def _gemma3_gguf_fields(layers: int, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """What a Gemma 3 GGUF implies beyond the Llama fields, as llama.cpp reads it: every sixth layer attends to
    the whole context, the others within the window at RoPE base 10000 (no GGUF key for either); the norms
    already hold 1 + w (llama.cpp's converter added the offset HF checkpoints leave out)."""
    # no query_pre_attn_scalar either: llama.cpp takes hidden / heads for the 27B (62 layers), else head_dim
    return gemma3_fields(hidden, gemma3_window_layers(layers), hidden // heads if layers == 62 else head_dim)


def unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's converter permutation of a Llama Q or K projection (weight or bias).

    llama.cpp stores each head's rotary pairs interleaved (``reshape(n_head, 2, d//n_head//2, ...)
    .swapaxes(1, 2)``); HF keeps the two halves apart. This is that permutation's inverse.

    Args:
        w: ``[n_heads * head_dim, ...]`` tensor as stored in the GGUF file.
        n_heads: query heads for Q, key/value heads for K.
    """
    rest = w.shape[1:]
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


class GGUFTensors(Mapping[str, torch.Tensor]):
    """A GGUF file's tensors by HF name, each read from the file when asked for and never kept, so that a
    model is built one tensor at a time (llama.cpp's rotary row order of Llama Q/K undone on every read).

    Args:
        gguf: the parsed header.
        config: the architecture (its head counts undo the Q/K row order).
        names: HF name of each GGUF tensor name that is a weight (the others are not offered).
    """

    def __init__(self, gguf: GGUFFile, config: ModelConfig, names: dict[str, str]) -> None:
        self.path, self.config = gguf.path, config
        self.infos = {names[i.name]: i for i in gguf.tensors.values() if i.name in names}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read(name, torch.float32)

    def __iter__(self) -> Iterator[str]:
        return iter(self.infos)

    def __contains__(self, name: object) -> bool:  # Mapping's own would read the tensor
        return name in self.infos

    def __len__(self) -> int:
        return len(self.infos)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: info.shape for name, info in self.infos.items()}

    def formats(self) -> dict[str, str]:
        """Our format of each matrix as stored (``weights.FORMAT_OF``; types not listed: q8_0)."""
        return {name: FORMAT_OF.get(info.qtype, "q8_0") for name, info in self.infos.items() if len(info.shape) == 2}

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor ``name`` dequantized into ``dtype``, ``_CHUNK`` values at a time (a float32 copy of a whole
        150k-row table is never made)."""
        info = self.infos[name]
        raw = self._raw(info)
        if len(info.shape) == 1:
            return self._ordered(name, dequantized(raw, info.qtype, info.shape).to(dtype))
        n, k = info.shape
        rows, step = raw.reshape(n, -1), max(1, _CHUNK // k)
        out = torch.empty(info.shape, dtype=dtype)
        for i in range(0, n, step):
            part = rows[i:i + step]
            out[i:i + len(part)] = dequantized(part, info.qtype, (len(part), k))
        return self._ordered(name, out)

    def blocks(self, name: str, fmt: str) -> Blocks:
        """Matrix ``name`` in block format ``fmt``: its own blocks where it is stored so (``weights.convert``)."""
        info = self.infos[name]
        blocks = convert(self._raw(info), info.qtype, info.shape, fmt)
        order = self._order(name, info.shape[0])
        return blocks if order is None else blocks.rows(order)

    def _raw(self, info: GGUFTensorInfo) -> np.ndarray:
        with open(self.path, "rb") as f:
            return read_gguf_raw(f, info)

    def _order(self, name: str, n: int) -> torch.Tensor | None:
        """The row order that undoes llama.cpp's rotary permutation of a Llama Q/K projection, else None."""
        heads = {".self_attn.q_proj.": self.config.num_heads, ".self_attn.k_proj.": self.config.num_kv_heads}
        for part, n_heads in heads.items():
            if self.config.arch == "llama" and part in name:
                return unpermute_rotary(torch.arange(n)[:, None], n_heads)[:, 0]
        return None

    def _ordered(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        order = self._order(name, tensor.shape[0])
        return tensor if order is None else tensor[order].contiguous()


_CHUNK = 1 << 22  # values dequantized at a time: 16 MB of float32


def load_gguf(path: str | os.PathLike[str], progress: Progress | None = None) -> Checkpoint:
    """Loads a GGUF file: config from metadata, its tensors with HF names (read when used), tokenizer.

    Nothing is dequantized here: ``Checkpoint.tensors`` reads each tensor from the file when asked for, and
    ``Checkpoint.weights`` hands the packer each matrix's own blocks.

    Args:
        path: the ``.gguf`` file.
        progress: called with one-line status messages.

    Raises:
        GGUFError: the file is not a readable GGUF file.
        LoadError: the model uses something this decoder does not support.
    """
    gguf = read_gguf(path)
    config = gguf_config(gguf)
    mapped = {name: hf_name(name, config.sandwich_norms) for name in gguf.tensors if name != ROPE_FACTORS}
    unknown = [name for name, hf in mapped.items() if hf is None]
    if unknown:
        raise LoadError(f"{gguf.path}: tensors with no {config.arch} counterpart here: {unknown[:8]}")
    tensors = GGUFTensors(gguf, config, {name: hf for name, hf in mapped.items() if hf is not None})
    check_tensors(config, tensors.shapes(), str(gguf.path))
    tokenizer = Tokenizer.from_gguf(gguf.path, metadata=gguf.metadata)
    stored = WeightSource(tensors, tensors.formats(), tensors.blocks, tensors.read)
    return Checkpoint(config, tensors, tokenizer, str(gguf.path), stored, gguf.path)


# ----------------------------------------------------------------------------------------------
# HF folders and hub ids

def check_tensors(config: ModelConfig, shapes: Mapping[str, tuple[int, ...]], source: str) -> None:
    """Raises LoadError unless ``shapes`` holds exactly the expected names with the expected shapes.

    Args:
        config: the architecture the tensors must fit.
        shapes: HF-named tensors' shapes.
        source: named in the error message.
    """
    expected = expected_tensor_shapes(config)
    missing = [n for n in expected if n not in shapes]
    extra = [n for n in shapes if n not in expected]
    wrong = [f"{n} {tuple(shapes[n])} != {expected[n]}" for n in expected
             if n in shapes and tuple(shapes[n]) != expected[n]]
    problems = [f"{label}: {items[:5]}{' ...' if len(items) > 5 else ''}"
                for label, items in (("missing", missing), ("unexpected", extra), ("wrong shape", wrong)) if items]
    if problems:
        raise LoadError(f"{source}: tensors do not match the {config.arch} config; " + "; ".join(problems))


def load_hf_dir(path: str | os.PathLike[str], progress: Progress | None = None) -> Checkpoint:
    """Loads a HF model folder: ``config.json``, ``*.safetensors`` (sharded or not), tokenizer files.

    Args:
        path: the folder.
        progress: called with one-line status messages.

    Raises:
        LoadError: missing or unsupported files, or tensors that do not fit the config.
    """
    from safetensors import safe_open

    folder = Path(path)
    say = progress or (lambda _msg: None)
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("quantization_config"):
        raise LoadError(f"{folder}: quantized HF checkpoints ({cfg['quantization_config'].get('quant_method')}) "
                        "are not supported; use an unquantized folder or a GGUF file")
    try:
        config = ModelConfig.from_hf(cfg)
    except (KeyError, ValueError) as exc:
        raise LoadError(f"{folder}/config.json: {exc}") from exc
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, AttributeError, TypeError) as exc:
            raise LoadError(f"{index}: not a safetensors index with a 'weight_map' ({exc!r})") from exc
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{folder}: no *.safetensors weights (pytorch_model.bin is not supported)")
    say(f"reading {len(files)} safetensors file(s) from {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as sf:
                for name in sf.keys():
                    # Older exports carry a precomputed rotary table; the decoder computes its own.
                    if not name.endswith("rotary_emb.inv_freq"):
                        tensors[name] = sf.get_tensor(name).to(torch.float32)
        except Exception as exc:  # SafetensorError derives from Exception only
            raise LoadError(f"{file}: cannot read safetensors weights ({exc})") from exc
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    if config.norm_offset:  # Gemma's checkpoints store w for x * (1 + w); our norms take the factor itself
        for name in [n for n in tensors if n.endswith("norm.weight")]:
            tensors[name] = tensors[name] + config.norm_offset
    check_tensors(config, {n: tuple(t.shape) for n, t in tensors.items()}, str(folder))
    return Checkpoint(config, tensors, Tokenizer.from_hf_dir(folder), str(folder))


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
              "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"]


def _registry_hint() -> str:
    return "registered models: " + ", ".join(m.name for m in registry.list_models())


def _hub_snapshot(repo_id: str, say: Progress) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise LoadError(f"{repo_id!r} is not a local path or a registered name, and loading it from the "
                        f"Hugging Face hub needs huggingface_hub (pip install 'specdecode[hub]'); "
                        f"{_registry_hint()}") from None
    say(f"downloading {repo_id} from the Hugging Face hub")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except Exception as exc:  # the hub client raises many unrelated types (HTTP, offline, auth, not found)
        raise LoadError(f"could not download {repo_id!r} from the Hugging Face hub "
                        f"({type(exc).__name__}: {exc}); offline? {_registry_hint()}") from exc


def _looks_like_path(source: str) -> bool:
    return (source.startswith(("/", ".", "~")) or "\\" in source or source.count("/") > 1
            or source.endswith((".gguf", ".safetensors", ".json")))


def load_checkpoint(source: str, progress: Progress | None = None) -> Checkpoint:
    """Loads a checkpoint from a registry name, a ``.gguf`` file, a HF folder or a hub id.

    Resolution order: registry name (fetched once, then cached); existing file (GGUF); existing
    folder (HF layout); something path-like that does not exist (error); ``org/name`` hub id.

    Args:
        source: what to load, e.g. ``smollm2-135m-instruct``, ``model.gguf``, ``./my-model``, ``Qwen/Qwen2.5-0.5B``.
        progress: called with one-line status messages (download, dequantize).

    Raises:
        FileNotFoundError: a path-like source that does not exist.
        registry.UnknownModelError: a bare name that is not registered.
        LoadError: the source exists but cannot be loaded (GGUFError for unreadable GGUF files).
        specdecode.models.fetch.FetchError: a registered model could not be downloaded.
    """
    say = progress or (lambda _msg: None)
    try:
        model = registry.get(source)
    except registry.UnknownModelError:
        model = None
    if model is not None:
        return load_gguf(fetch(model, progress=say), progress=say)
    path = Path(source).expanduser()
    if path.is_file():
        return load_gguf(path, progress=say)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise LoadError(f"{path}: folder has no config.json, so it is not a HF model folder")
        return load_hf_dir(path, progress=say)
    if _looks_like_path(source):
        raise FileNotFoundError(f"model file or folder not found: {source}")
    if _HUB_ID.fullmatch(source):
        snapshot = _hub_snapshot(source, say)
        if not (snapshot / "config.json").is_file():
            raise LoadError(f"hub repo {source!r} has no config.json "
                            "(GGUF-only repos: download the .gguf and pass its path)")
        return load_hf_dir(snapshot, progress=say)
    raise registry.UnknownModelError(
        f"{source!r} is not a registered model, an existing path or an org/name hub id; {_registry_hint()}"
    )
