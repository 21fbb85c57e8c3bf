"""Builds and loads the tiled bf16 matmul kernel (``kernels/tiled_bf16.cpp``) on first use.

The kernel is compiled once per torch version with the system's C++ compiler and ninja (about 30 s;
torch caches the result under ``~/.cache/torch_extensions``). It needs an x86-64 CPU with AVX512-BF16.
Where it cannot be had, ``unavailable_reason`` says why and callers fall back to oneDNN.

This module does not choose between kernels (``Transformer.pack_weights`` does) and never compiles
anything at import time.
"""

from __future__ import annotations

import platform
import shutil
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

SOURCE = Path(__file__).with_name("kernels") / "tiled_bf16.cpp"
TILE = 64  # outputs per tile, as in the kernel
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp"]


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, e.g. not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _static_reason() -> str | None:
    """Why the kernel cannot run here, judged without compiling; None if it may."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"needs an x86-64 CPU (this is {platform.machine()})"
    missing = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} - cpu_flags()
    if missing:
        return f"the CPU lacks {', '.join(sorted(missing))}"
    if shutil.which("ninja") is None:
        return "ninja is not on PATH (needed to compile the kernel)"
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler on PATH"
    return None


_built: tuple[ModuleType | None, str | None] | None = None  # (module, reason), set by the first _build


def _build(log: Callable[[str], None] | None) -> tuple[ModuleType | None, str | None]:
    global _built
    if _built is not None:
        return _built
    reason = _static_reason()
    if reason is not None:
        _built = (None, reason)
        return _built
    if log is not None:
        log("loading the tiled bf16 kernel (its first use compiles it: about 30 s)")
    try:
        from torch.utils.cpp_extension import load  # imports setuptools: a dependency of ours

        _built = (load("specdecode_tiled_bf16", [str(SOURCE)], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"]), None)
    except Exception as exc:  # a compiler (or import) error: keep its last line; callers fall back
        last = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
        _built = (None, f"compiling {SOURCE.name} failed: {last[0]}")
    return _built


def kernel(log: Callable[[str], None] | None = None) -> ModuleType | None:
    """The compiled kernel module, or None where it is unavailable (see ``unavailable_reason``).

    Args:
        log: told once, before a first build, that compiling may take a while.
    """
    return _build(log)[0]


def unavailable_reason(log: Callable[[str], None] | None = None) -> str | None:
    """Why the kernel cannot be used here, or None when it can (builds it if needed)."""
    return _build(log)[1]


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` bf16 -> ``[ceil(N/64), ceil(K/2), 64, 2]``, zero-padded, as the kernel reads it."""
    n, k = weight.shape
    n_pad, k_pad = -n % TILE, k % 2
    padded = torch.nn.functional.pad(weight.detach(), (0, k_pad, 0, n_pad))  # [N', K']
    return padded.view(-1, TILE, (k + k_pad) // 2, 2).transpose(1, 2).contiguous()
