"""From a model source (registry name, .gguf path, HF folder, hub id) to a ready model and tokenizer: the
one load path, which resolves the backend once (``resolve_backend``) and hands that ``Backend`` down.

Glue only: parsing and dequantizing live in ``loader.py``, the network in ``fetch.py``, the maths in
``transformer.py``, the backends in ``backends/``, how projections are packed in ``packing.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from specdecode.models.config import ModelConfig
from specdecode.models.hf_import import hf_state_dict, unpacked_state
from specdecode.models.loader import Checkpoint, load_checkpoint
from specdecode.models import native, packed_cache, packing
from specdecode.models.tokenizer import Tokenizer
from specdecode.models.backends import AUTO, INT8, Backend, resolve_backend
from specdecode.models.transformer import Transformer
from specdecode.models.weights import BLOCK_REQUESTS, WEIGHT_FORMATS, WHOLE_Q4, WeightSource

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
DRAFT_QUANT = ("none", "int8")  # weight-only quantization offered for draft models
CHEAPEST = "cheapest"  # a draft model's default format: see draft_format
DRAFT_WEIGHTS = (CHEAPEST, *WEIGHT_FORMATS)
DEVICES = ("auto", "cpu", "cuda")  # also "cuda:N"


def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX); elsewhere libraries emulate it slowly."""
    return bool({"avx512_bf16", "amx_bf16"} & native.cpu_flags())


def cpu_runs_bf16() -> bool:
    """True when one of our kernels can run bf16 projections here: natively, or widened to fp32 in
    registers (AVX512F, AVX2 + FMA), from half the bytes of fp32 weights. Judged from the CPU flags
    alone, without compiling; a build that then fails to compile falls back (see ``native``)."""
    flags = native.cpu_flags()
    return any(set(build.needs) <= flags for build in native.BUILDS.values())


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """Maps "auto" / "bfloat16" / "float32" / "float16" to a torch dtype.

    Args:
        name: the requested dtype; "auto" picks bf16 where the hardware or our kernels compute it fast
            (``cpu_runs_bf16``; on CUDA where the GPU supports it), else fp32.
        device: "cpu" or "cuda".
    """
    if name == "auto":
        fast = torch.cuda.is_bf16_supported() if device.startswith("cuda") else cpu_runs_bf16()
        return torch.bfloat16 if fast else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass
class LoadedModel:
    """A model ready to run, with its tokenizer.

    Args:
        model: the decoder.
        tokenizer: its tokenizer (with chat template when the checkpoint has one).
        source: where it came from, for messages and cache keys.
    """

    model: Transformer
    tokenizer: Tokenizer
    source: str


def resolve_device(name: str) -> str:
    """Maps "auto" / "cpu" / "cuda" / "cuda:N" to the device a model is loaded on.

    Args:
        name: "auto" picks "cuda" where ``torch.cuda.is_available()``, else "cpu".

    Raises:
        ValueError: an unknown name, or a CUDA device this machine does not have (the message names it).
    """
    name = str(name)  # a torch.device too
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    kind, sep, index = name.partition(":")
    if kind != "cuda" or (sep and not index.isdigit()):
        raise ValueError(f"device {name!r} is not one of auto, cpu, cuda, cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: torch.cuda.is_available() is False (this torch build is CPU-only or no "
                         "GPU is visible)")
    if sep and int(index) >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return name


def check_weights(weights: str, backend: Backend) -> None:
    """Refuses, before any weights are read, a block format (``--weights``) on a backend that computes bf16 only.

    Args:
        weights: one of WEIGHT_FORMATS.
        backend: the resolved backend.
    """
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {weights!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    if weights in BLOCK_REQUESTS and not backend.block_formats:
        why = "" if backend.packs else " (no AVX2+FMA CPU, another device, or a float32 model)"
        raise ValueError(f"--weights {weights} needs one of our kernels (a backend that computes block formats); the "
                         f"projections would run on {backend.name}{why}")


def draft_format(requested: str, backend: Backend) -> str:
    """The weight format a draft model is loaded in: ``requested``, where "cheapest" means q4_1 with a q4_1
    output head (``WHOLE_Q4``) on a backend that computes block formats (a q4 step streams ~0.3 of bf16's
    bytes and q4_1 rounds finer than q4_0; a draft's format changes how often it is right, never the output),
    else "auto"."""
    if requested != CHEAPEST:
        return requested
    return WHOLE_Q4 if backend.block_formats else "auto"


def load_model(source: str, dtype: str = "auto", device: str = "cpu",
               progress: Callable[[str], None] | None = None, linear: str = "auto",
               quantize: str = "none", weights: str = "auto") -> LoadedModel:
    """Loads a model by registry name, ``.gguf`` path, HF folder or hub id.

    Args:
        source: what to load.
        dtype: "auto", "bfloat16", "float32" or "float16".
        device: "cpu", "cuda", "cuda:N" or "auto" (see ``resolve_device``).
        progress: called with one-line status messages (fetching, loading).
        linear: kernel for the projections, a ``--linear`` name (``backends.LINEAR_CHOICES``; "auto" picks the
            fastest, see ``resolve_backend``).
        quantize: "int8" for int8 weight-only projections (draft models; different numbers), or "none".
        weights: the projections' format (``packing.pack``): "auto" (a GGUF's own formats on our kernels, else
            bf16), "blocks" (as auto, K-quants in 32-weight blocks), "bf16", "q8_0", "q4_0" or "q4_1".
    """
    device = resolve_device(device)  # a missing GPU is refused before any weights are read
    torch_dtype = resolve_dtype(dtype, device)
    if quantize not in DRAFT_QUANT:
        raise ValueError(f"quantize {quantize!r} is not one of {', '.join(DRAFT_QUANT)}")
    backend = INT8  # int8 weight-only copies: ``linear`` and ``weights`` do not apply
    if quantize == "none":  # a kernel or format that cannot run is refused before any weights are read
        backend = resolve_backend(linear, torch_dtype, torch.device(device), progress)
        check_weights(weights, backend)
    return from_checkpoint(load_checkpoint(source, progress=progress), torch_dtype, backend, device,
                           progress=progress, weights=weights)


def from_checkpoint(ckpt: Checkpoint, dtype: torch.dtype, backend: Backend, device: str = "cpu",
                    progress: Callable[[str], None] | None = None, weights: str = "auto") -> LoadedModel:
    """Builds our decoder from loaded weights (the checkpoint's tensors stay usable, e.g. for a peer). On a
    backend that packs projections they are read and packed one at a time (``packed_from``).

    Args:
        ckpt: the loaded checkpoint.
        dtype: parameter dtype.
        backend: where the projections run (``resolve_backend``'s, or ``backends.INT8``: int8 weight-only
            copies of the projections, and ``weights`` is ignored).
        device: torch device string.
        progress: told about a first compile of one of our kernels, and about packing.
        weights: the projections' format (see ``load_model``).
    """
    if backend is INT8:  # quantized from the model's own weights, as a draft model always was
        model = from_hf_tensors(ckpt.config, ckpt.tensors, dtype).to(device)
        packing.pack(model, INT8)
    elif backend.packs:
        model = _packed(ckpt, dtype, backend, weights, progress or (lambda _m: None))
    else:  # torch: the projections stay the model's own; packing only checks the format
        model = from_hf_tensors(ckpt.config, ckpt.tensors, dtype).to(device)
        packing.pack(model, backend, weights, ckpt.weights, progress)
    return LoadedModel(model, ckpt.tokenizer, ckpt.source)


def from_hf_tensors(config: ModelConfig, tensors: Mapping[str, torch.Tensor],
                    dtype: torch.dtype = torch.float32) -> Transformer:
    """The model built from HF-named weights (``hf_import.py``), q/k/v and gate/up fused, its projections
    unpacked (``packing.pack`` or ``pack_model`` move it onto a backend).

    Args:
        config: the architecture.
        tensors: weights named as in HF checkpoints (``model.layers.0.self_attn.q_proj.weight`` ...).
        dtype: parameter dtype.
    """
    state = hf_state_dict(config, tensors, dtype)
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def packed_from(config: ModelConfig, source: WeightSource, dtype: torch.dtype, backend: Backend,
                weights: str = AUTO, log: Callable[[str], None] | None = None) -> Transformer:
    """The model with its projections packed for ``backend`` (one that ``packs``), reading the checkpoint one
    projection at a time: no float copy of the whole model is ever held, as ``from_hf_tensors`` followed by
    ``packing.pack`` would.

    Args:
        config: the architecture.
        source: the checkpoint's weights (``Checkpoint.weights``).
        dtype: the model dtype (the embedding table, norms but Gemma's, and bf16 projections).
        backend: a packing backend.
        weights: one of WEIGHT_FORMATS, as for ``packing.pack``.
        log: told how far packing has come.
    """
    if not backend.packs:
        raise ValueError(f"{backend.name} does not pack projections; build the model with from_hf_tensors")
    with torch.device("meta"):
        model = Transformer(config)
    state = unpacked_state(config, source.float, dtype)
    model.load_state_dict(state, strict=False, assign=True)  # projections stay on meta until packed
    model.eval().requires_grad_(False)
    packing.pack(model, backend, weights, source, log)
    return model


def pack_model(model: Transformer, linear: str = AUTO, weights: str = AUTO, source: WeightSource | None = None,
               log: Callable[[str], None] | None = None, fuse: bool = True) -> Backend:
    """Moves a built model onto the backend a ``--linear`` name resolves to (once, here), as ``packing.pack``
    does; asked again for its own backend and weights (or "auto") it changes nothing.

    Args:
        model: a model from ``from_hf_tensors`` (or one packed already).
        linear: a ``--linear`` name (``backends.LINEAR_CHOICES``; "auto": see ``resolve_backend``).
        weights, source, fuse: as for ``packing.pack``.
        log: told about a first compile of one of our kernels.

    Returns:
        The backend the projections now run on.

    Raises:
        ValueError: an unknown kernel or format, one that cannot run this model here (the reason is named), or
            another backend or format than a packed model's own.
    """
    if model.head_layer is not None:
        packing.check_repack(model, linear, weights)
        return model.backend
    backend = resolve_backend(linear, model.dtype, model.device, log)
    packing.pack(model, backend, weights, source, log, fuse)
    return backend


def _packed(ckpt: Checkpoint, dtype: torch.dtype, backend: Backend, weights: str,
            say: Callable[[str], None]) -> Transformer:
    """The checkpoint packed for ``backend``: read back from ``packed_cache`` where a GGUF file was packed so
    before, else packed one projection at a time (and saved for the next start)."""
    if ckpt.file is None or not packed_cache.serves(backend):
        return packed_from(ckpt.config, ckpt.weights, dtype, backend, weights, say)
    key = packed_cache.EntryKey.of(ckpt.file, weights, backend, dtype)
    model = packed_cache.load(key, ckpt.config, backend, say)
    if model is None:
        say(f"packing {ckpt.file.name} for {backend.name} (first start with these settings; the packed model is "
            f"kept in {packed_cache.folder()})")
        model = packed_from(ckpt.config, ckpt.weights, dtype, backend, weights, say)
        packed_cache.save(key, model, say)
    return model
