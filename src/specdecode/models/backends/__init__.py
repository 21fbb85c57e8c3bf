"""Backends: where a model's projections and layers run. ``resolve_backend`` turns a ``--linear`` name into
one: our compiled kernels (``compiled.py``: tiled, avx512, avx2), oneDNN or plain torch (``torch_ops.py``);
"auto" picks the first of them that runs here (``$SPECDECODE_LINEAR`` can force one).

The protocol they follow is in ``base.py``. This package does not pack a model (``packing.py`` does, with a
backend's projections) and does not hold the model's maths (``transformer.py``).
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from specdecode.models import native
from specdecode.models.backends.base import Backend, EagerLayers, LayerRunner, OutputHead
from specdecode.models.backends.compiled import NativeBackend
from specdecode.models.backends.torch_ops import Int8Backend, OneDnnBackend, TorchBackend

# What --linear offers, in the order "auto" tries them: ours (native.BUILDS), then oneDNN, then F.linear.
BACKENDS: dict[str, Backend] = {**{name: NativeBackend(name) for name in native.BUILDS},
                                "onednn": OneDnnBackend(), "torch": TorchBackend()}
AUTO = "auto"
LINEAR_CHOICES = (AUTO, *BACKENDS)
LINEAR_ENV = "SPECDECODE_LINEAR"  # forces a backend wherever "auto" is asked for (tests, CI, the CLI)
TORCH = BACKENDS["torch"]
INT8 = Int8Backend()  # not a --linear choice: draft models get it from --quantize int8


def backend_problem(name: str, dtype: torch.dtype, device: torch.device,
                    log: Callable[[str], None] | None = None) -> str | None:
    """Why backend ``name`` cannot run the projections of a ``dtype`` model on ``device`` here, or None.

    Args:
        name: one of LINEAR_CHOICES.
        dtype: the model's parameter dtype.
        device: where the model lives.
        log: told about a first compile of one of our kernels (asking builds it).
    """
    if name == AUTO:
        return None
    if name not in BACKENDS:
        return f"linear kernel {name!r} is not one of {', '.join(LINEAR_CHOICES)}"
    return BACKENDS[name].problem(dtype, device, log)


def resolve_backend(name: str, dtype: torch.dtype, device: torch.device,
                    log: Callable[[str], None] | None = None) -> Backend:
    """The backend a model's projections will run on: ``name``'s, or for "auto" the one in ``$SPECDECODE_LINEAR``
    if set, else the first of BACKENDS that can run here.

    Raises:
        ValueError: ``name`` is unknown or cannot run here; the message says why.
    """
    forced = os.environ.get(LINEAR_ENV, AUTO).strip() or AUTO
    if name == AUTO and forced != AUTO:
        problem = backend_problem(forced, dtype, device, log)
        if problem is not None:
            raise ValueError(f"{LINEAR_ENV}={forced}: {problem}")
        return BACKENDS[forced]
    problem = backend_problem(name, dtype, device, log)
    if problem is not None:
        raise ValueError(problem)
    if name != AUTO:
        return BACKENDS[name]
    return next(b for b in BACKENDS.values() if b.problem(dtype, device, log) is None)  # torch always runs


__all__ = ["AUTO", "BACKENDS", "Backend", "EagerLayers", "INT8", "Int8Backend", "LINEAR_CHOICES", "LINEAR_ENV",
           "LayerRunner", "NativeBackend", "OneDnnBackend", "OutputHead", "TORCH", "TorchBackend", "backend_problem",
           "resolve_backend"]
