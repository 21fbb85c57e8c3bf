"""Builds and loads our compiled CPU kernels on first use, one build per instruction set.

One source, ``kernels/cpu_kernels.cpp`` (with its headers), compiled three ways as torch C++ extensions
with the system's C++ compiler and ninja (about 60 s each, once per source version; torch caches them
under ``~/.cache/torch_extensions``):

- ``tiled``: AVX512-BF16 dot products for bf16 weights, AVX512-VNNI for quantized ones.
- ``avx512``: bf16 weights widened to fp32 in registers (AVX512F), AVX512-VNNI for quantized ones.
- ``avx2``: the same for AVX2 + FMA (quantized dot products with vpmaddubsw; F16C for their fp16 scales).

Every build carries the bf16 projections, the quantized projections (``linear_quant.h``), our attention
and the fused decoder layer (``layer.h``). Where a build cannot run, ``unavailable_reason`` names the
missing CPU feature or tool and callers fall back. An AVX512 CPU without VNNI (Skylake-SP) runs ``avx2``.

``compile_extension`` builds any of our other torch C++ extensions the same way (the suffix trie,
``drafters/suffix_trie.cpp``); ``prebuild`` compiles every build this CPU runs at once, one process each (``make
test`` does, before its workers start). This module does not choose between paths (``backends.resolve_backend``
does) and never compiles anything at import time.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import platform
import shutil
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Callable, Sequence

import torch

KERNELS = Path(__file__).with_name("kernels")
SOURCE = KERNELS / "cpu_kernels.cpp"
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-DSPECDECODE_AVX512", "-DSPECDECODE_VNNI")


@dataclass(frozen=True)
class Build:
    """One compiled variant: its source, the CPU flags it needs (as /proc/cpuinfo names them) and its flags."""

    source: Path
    needs: tuple[str, ...]
    cflags: tuple[str, ...]
    tile: int  # outputs per packed bf16 weight tile
    quant_tile: int  # outputs per packed quantized weight tile
    bf16_linear: str  # the compiled op of its bf16 projections


BUILDS: dict[str, Build] = {
    "tiled": Build(SOURCE, ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"),
                   (*_AVX512, "-mavx512bf16", "-DSPECDECODE_TILED"), 64, 32, "tiled_linear"),
    "avx512": Build(SOURCE, ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"), _AVX512, 64, 32, "widened_linear"),
    "avx2": Build(SOURCE, ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c"), 32, 16, "widened_linear"),
}
# Sums are never reassociated or contracted behind our back: the kernels spell out every FMA they use.
COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")


def source_digest() -> str:
    """A short hash of the kernel sources, part of each extension's name: an edited header rebuilds it."""
    h = hashlib.sha256()
    for path in sorted(KERNELS.glob("*.[ch]*")):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:10]


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


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _static_reason(name: str) -> str | None:
    """Why build ``name`` cannot run here, judged without compiling; None if it may."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"needs an x86-64 CPU (this is {platform.machine()})"
    missing = set(BUILDS[name].needs) - cpu_flags()
    if missing:
        return f"the CPU lacks {', '.join(sorted(missing))}"
    return _tools_reason()


def _tools_reason() -> str | None:
    """Why nothing can be compiled here (no ninja or C++ compiler on PATH); None if it can."""
    if shutil.which("ninja") is None:
        return "ninja is not on PATH (needed to compile native code)"
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler on PATH"
    return None


def compile_extension(name: str, source: Path, what: str, cflags: tuple[str, ...] = ("-O3",),
                      ldflags: tuple[str, ...] = ()) -> tuple[ModuleType | None, str | None]:
    """Compiles (once per source version: ``name`` should carry its digest) and loads the torch C++ extension
    ``source``; returns (module, None), or (None, why not) where no tools are found or the compiler fails
    (``what`` it is built for named in the reason)."""
    reason = _tools_reason()
    if reason is not None:
        return None, reason
    try:
        from torch.utils.cpp_extension import load  # imports setuptools: a dependency of ours

        return load(name, [str(source)], extra_cflags=list(cflags), extra_ldflags=list(ldflags)), None
    except Exception as exc:  # a compiler (or import) error: keep its last line; callers fall back
        last = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
        return None, f"compiling {source.name} for {what} failed: {last[0]}"


_built: dict[str, tuple[ModuleType | None, str | None]] = {}  # name -> (module, reason), set by the first _build


def _build(name: str, log: Callable[[str], None] | None) -> tuple[ModuleType | None, str | None]:
    if name not in BUILDS:
        raise ValueError(f"no kernel build named {name!r} (builds: {', '.join(BUILDS)})")
    if name in _built:
        return _built[name]
    reason = _static_reason(name)
    if reason is not None:
        _built[name] = (None, reason)
        return _built[name]
    build = BUILDS[name]
    if log is not None:
        log(f"loading the {name} kernels (compiled at their first use on this machine: about a minute; then cached)")
    _built[name] = compile_extension(f"specdecode_{name}_{source_digest()}", build.source, name,
                                     (*COMMON_FLAGS, *build.cflags), ("-fopenmp",))
    return _built[name]


def kernel(name: str, log: Callable[[str], None] | None = None) -> ModuleType | None:
    """The compiled module of build ``name``, or None where it is unavailable (see ``unavailable_reason``).

    Args:
        name: one of BUILDS.
        log: told once, before a first build, that compiling may take a while.
    """
    return _build(name, log)[0]


def unavailable_reason(name: str, log: Callable[[str], None] | None = None) -> str | None:
    """Why build ``name`` cannot be used here, or None when it can (builds it if needed)."""
    return _build(name, log)[1]


def prebuild(names: Sequence[str] = tuple(BUILDS)) -> dict[str, str | None]:
    """Compiles the builds ``names`` that this CPU can run at once, each in a process of its own (one core each),
    so that their first uses load them ready: a test run's workers otherwise wait on each other's compiles, one core
    idle. Returns each build's reason where it is unavailable (None: ready)."""
    reasons = {name: _static_reason(name) for name in names}
    todo = [name for name, reason in reasons.items() if reason is None]
    if todo:  # spawned: a fresh interpreter per build, no OpenMP team forked from this one
        with ProcessPoolExecutor(len(todo), mp_context=multiprocessing.get_context("spawn")) as pool:
            reasons.update(zip(todo, pool.map(unavailable_reason, todo)))
    return reasons


def set_prefetch_level(level: int) -> None:
    """Where the quantized kernels of every build loaded so far prefetch a projection's next tile: 0 into L1, 1
    into L2. Each build starts from the L1 data cache's size (L1 where it is 48 KB or more); a benchmark's switch
    (``benchmarks/prefetch_level.py``), not a setting: the bits are the same either way."""
    if level not in (0, 1):
        raise ValueError(f"prefetch level must be 0 (L1) or 1 (L2), not {level!r}")
    for module, _ in _built.values():
        if module is not None:
            module.set_prefetch_level(level)


def pack(weight: torch.Tensor, tile: int = 64) -> torch.Tensor:
    """``[N, K]`` bf16 -> ``[ceil(N/tile), ceil(K/2), tile, 2]``, zero-padded, as the kernels read it."""
    n, k = weight.shape
    n_pad, k_pad = -n % tile, k % 2
    padded = torch.nn.functional.pad(weight.detach(), (0, k_pad, 0, n_pad))  # [N', K']
    return padded.view(-1, tile, (k + k_pad) // 2, 2).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The ``[N, K]`` weight that ``pack`` turned into ``packed`` (padding dropped)."""
    tiles, pairs, tile, _ = packed.shape
    return packed.transpose(1, 2).reshape(tiles * tile, pairs * 2)[:n, :k]


# `python -m specdecode.models.native`: `make test` compiles the builds before its workers start.
if __name__ == "__main__":
    print("the kernels' builds: compiling those this CPU runs, at once (about 100 s the first time) ...", flush=True)
    for build, why in prebuild().items():
        print(f"  {build}: {why or 'ready'}")
