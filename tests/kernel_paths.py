"""The kernel paths a model can run on, for tests that must hold on each: a path this CPU cannot run is
skipped with the reason (``pytest -rs`` prints it), never silently."""

from __future__ import annotations

import pytest
import torch

from specdecode.models.linear import NATIVE_KERNELS
from specdecode.models.transformer import linear_kernel_problem

PATHS = (*NATIVE_KERNELS, "onednn", "torch")  # every value of --linear but auto


def path_problem(path: str, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why ``path`` cannot run a ``dtype`` model on this machine's CPU, or None."""
    return linear_kernel_problem(path, dtype, torch.device("cpu"))


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
