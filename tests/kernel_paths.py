"""The kernel paths a model can run on, for tests that must hold on each: a path this CPU cannot run is
skipped with the reason (``pytest -rs`` prints it), never silently."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdecode.models import native
from specdecode.models.backends import BACKENDS, backend_problem

NATIVE_PATHS = tuple(native.BUILDS)  # our compiled kernels' backends
PATHS = tuple(BACKENDS)  # every value of --linear but auto


def path_problem(path: str, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why ``path`` cannot run a ``dtype`` model on this machine's CPU, or None."""
    return backend_problem(path, dtype, torch.device("cpu"))


def require_path(path: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """Skips the calling test, naming the path and the reason, where this CPU cannot run ``path``."""
    problem = path_problem(path, dtype)
    if problem is not None:
        pytest.skip(f"path {path} cannot run here: {problem}")


def path_params(paths=PATHS) -> list:
    """``pytest.param``s for ``paths``, each marked to skip with its reason where it cannot run."""
    return [pytest.param(p, id=p, marks=pytest.mark.skipif(path_problem(p) is not None,
                                                             reason=f"path {p} cannot run here: {path_problem(p)}"))
            for p in paths]


def block_activations(x: torch.Tensor) -> torch.Tensor:
    """Rows of x as the block-format kernels quantize them (int8 per 32 inputs, fp32 scale amax / 127, codes
    rounded to nearest even), dequantized to float64: what their products multiply the weights with."""
    k = x.shape[-1]
    blocks = F.pad(x.float(), (0, -k % 32)).view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(torch.isfinite(1 / d), 1 / d, torch.zeros_like(d))  # all codes 0 where 1 / d overflows
    return (torch.round(blocks * inv).double() * d.double()).view(x.shape[0], -1)[:, :k]
