"""Our compiled kernels' builds: the reasons given where one cannot be had, the packed layout and tiles the
kernels read, and the builds that this CPU cannot run still compiling. (Which backend runs: see
``tests/models/backends/test_backend_registry.py``.)"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import torch

from specdecode.models import native
from fake_cpu import FLAGS
from kernel_paths import path_problem


def test_reasons_name_what_is_missing(monkeypatch):
    monkeypatch.setattr(native.platform, "machine", lambda: "aarch64")
    assert native._static_reason("avx2") == "needs an x86-64 CPU (this is aarch64)"
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(FLAGS["xeon-no-bf16"]))
    assert native._static_reason("tiled") == "the CPU lacks avx512_bf16"
    assert native._static_reason("avx512") is None
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(FLAGS["zen2"]))
    assert native._static_reason("avx512") == "the CPU lacks avx512_vnni, avx512bw, avx512f, avx512vl"
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(FLAGS["skylake-sp"]))
    assert native._static_reason("avx512") == "the CPU lacks avx512_vnni"
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2"}))
    assert native._static_reason("avx2") == "the CPU lacks f16c, fma"
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(FLAGS["zen4"]))
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    assert native._static_reason("tiled") == "ninja is not on PATH (needed to compile native code)"
    with pytest.raises(ValueError, match="no kernel build named 'sse'"):
        native.kernel("sse")


def test_prebuild_compiles_what_this_cpu_runs_and_names_why_not_the_rest(monkeypatch):
    # Run in processes of their own: a build this CPU cannot run is not started there, its reason comes back.
    real = native._static_reason
    monkeypatch.setattr(native, "_static_reason",
                        lambda name: "the CPU lacks a flag" if name == "avx512" else real(name))
    reasons = native.prebuild(("avx2", "avx512"))
    assert reasons == {"avx2": native.unavailable_reason("avx2"), "avx512": "the CPU lacks a flag"}


def test_pack_layout_pads_and_interleaves_pairs():
    weight = torch.arange(70 * 5, dtype=torch.float32).view(70, 5).to(torch.bfloat16)  # N = 70, K = 5 (odd)
    packed = native.pack(weight)
    assert packed.shape == (2, 3, 64, 2)  # ceil(70/64) tiles, ceil(5/2) feature pairs
    assert torch.equal(packed[0, 1, 7], weight[7, 2:4])  # tile 0, pair 1, output 7 = features 2, 3
    assert torch.equal(packed[1, 2, 5], torch.stack([weight[69, 4], torch.tensor(0, dtype=torch.bfloat16)]))
    assert not packed[1, :, 6:].any()  # outputs 70.. are zero padding
    assert native.pack(weight, 32).shape == (3, 3, 32, 2)  # the avx2 build's tile


@pytest.fixture(scope="module")
def compiles(tmp_path_factory) -> Iterator[dict[str, tuple[subprocess.Popen, Path]]]:
    """The compiles of the builds this CPU cannot run, all started at once (``name -> (process, stderr file)``):
    each is one single-threaded compiler, so on an AVX2-only CI machine with 2 cores tiled's and avx512's
    compiles take about as long together as one of them alone."""
    from torch.utils.cpp_extension import include_paths

    out = tmp_path_factory.mktemp("builds")
    started = {}
    for name, b in native.BUILDS.items():
        if path_problem(name) is None:
            continue
        # -c, not -fsyntax-only: an intrinsic the flags do not enable fails only when it is inlined.
        command = ["c++", "-std=c++20", "-c", "-O0", *b.cflags, "-DTORCH_EXTENSION_NAME=check",
                   *[f"-I{p}" for p in include_paths()], *[f"-I{p}" for p in _python_includes()], str(b.source),
                   "-o", str(out / f"{name}.o")]
        with open(out / f"{name}.err", "w") as err:
            started[name] = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err), out / f"{name}.err"
    yield started
    for proc, _ in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("name", list(native.BUILDS))
def test_every_build_compiles_even_where_it_cannot_run(name, compiles):
    """A build this CPU cannot run is still compiled (not run), so a change that breaks it fails here."""
    if path_problem(name) is None:
        assert native.kernel(name) is not None  # it runs here: compiled and loaded by the tests above
        return
    proc, stderr = compiles[name]
    assert proc.wait() == 0, stderr.read_text()[-2000:]


def _python_includes() -> list[str]:
    import sysconfig

    return [sysconfig.get_paths()["include"]]


@pytest.mark.parametrize("name", list(native.BUILDS))
def test_each_builds_tiles_are_what_the_packing_lays_out(name):
    """native.BUILDS' tile sizes and record sizes agree with what the compiled build reads."""
    if path_problem(name) is not None:
        pytest.skip(f"build {name} cannot run here: {path_problem(name)}")
    import numpy as np
    from gguf.constants import GGMLQuantizationType as QT
    from gguf.quants import quantize as gguf_quantize

    from specdecode.models.weights import FORMAT_CODES, BLOCK_FORMATS, from_gguf, quantize

    ops, b = native.kernel(name), native.BUILDS[name]
    assert ops.tile_outputs() == b.tile and ops.quant_tile_outputs() == b.quant_tile
    for fmt in BLOCK_FORMATS:
        assert quantize(torch.randn(3, 64), fmt).pack(b.quant_tile).shape[-1] == ops.quant_record_bytes(FORMAT_CODES[fmt])
    for qtype in (QT.Q5_0, QT.Q5_1):  # formats read as stored only
        stored = from_gguf(gguf_quantize(np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32), qtype),
                           qtype, (3, 64))
        assert stored.pack(b.quant_tile).shape[-1] == ops.quant_record_bytes(FORMAT_CODES[stored.fmt]), qtype
