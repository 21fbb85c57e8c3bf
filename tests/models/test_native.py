"""Our compiled kernels when they cannot be had (the reasons given, the fallback of ``pack_weights``, the
path forced by ``$SPECDECODE_LINEAR``), the choice of dtype and path from the CPU flags, and the builds
that this CPU cannot run still compiling."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import torch

from specdecode.models import build, native
from specdecode.models.linear import can_pack
from specdecode.models.transformer import LINEAR_ENV, resolve_linear_kernel
from kernel_paths import path_problem
from tiny_models import varied_model

CPU = torch.device("cpu")
FLAGS = {  # what /proc/cpuinfo shows on the CPU families this project meets
    "zen4": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"},
    "xeon-no-bf16": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
    "skylake-sp": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"},
    "zen2": {"avx2", "fma", "f16c"},
    "old": {"sse4_2", "avx"},
}


def _fake_cpu(monkeypatch, flags: set[str]) -> None:
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(native, "_built", {})  # judged anew (nothing is compiled: see the stub below)
    monkeypatch.setattr(native, "_build", lambda name, log: (None, native._static_reason(name))
                        if native._static_reason(name) else (object(), None))


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
    assert native._static_reason("tiled") == "ninja is not on PATH (needed to compile the kernel)"
    with pytest.raises(ValueError, match="no kernel build named 'sse'"):
        native.kernel("sse")


@pytest.mark.parametrize("cpu,dtype,path", [("zen4", torch.bfloat16, "tiled"), ("xeon-no-bf16", torch.bfloat16, "avx512"),
                                            ("skylake-sp", torch.bfloat16, "avx2"), ("zen2", torch.bfloat16, "avx2"),
                                            ("old", torch.float32, "torch")])
def test_auto_dtype_and_path_follow_the_cpu_flags(monkeypatch, cpu, dtype, path):
    _fake_cpu(monkeypatch, FLAGS[cpu])
    monkeypatch.delenv(LINEAR_ENV, raising=False)
    assert build.resolve_dtype("auto") == dtype
    assert build.cpu_has_fast_bf16() == (cpu == "zen4")
    if dtype == torch.bfloat16:
        assert resolve_linear_kernel("auto", dtype, CPU) == path
    else:
        assert resolve_linear_kernel("auto", dtype, CPU) == "torch"  # oneDNN packs bf16 only


@pytest.mark.parametrize("cpu,path,missing", [("xeon-no-bf16", "tiled", "avx512_bf16"),
                                              ("zen2", "avx512", "avx512_vnni, avx512bw, avx512f, avx512vl"),
                                              ("zen2", "tiled", "avx512_bf16, avx512_vnni, avx512bw, avx512f, avx512vl")])
def test_forcing_a_path_the_cpu_cannot_run_names_the_path_and_the_feature(monkeypatch, cpu, path, missing):
    _fake_cpu(monkeypatch, FLAGS[cpu])
    with pytest.raises(ValueError, match=f"the {path} kernel is unavailable: the CPU lacks {missing}$"):
        resolve_linear_kernel(path, torch.bfloat16, CPU)
    monkeypatch.setenv(LINEAR_ENV, path)  # the same through the environment, which names itself
    with pytest.raises(ValueError, match=f"{LINEAR_ENV}={path}: the {path} kernel is unavailable: the CPU lacks"):
        resolve_linear_kernel("auto", torch.bfloat16, CPU)


def test_the_environment_forces_a_path_and_an_explicit_kernel_wins(monkeypatch):
    monkeypatch.setenv(LINEAR_ENV, "torch")
    assert resolve_linear_kernel("auto", torch.bfloat16, CPU) == "torch"
    assert varied_model(0, dtype=torch.bfloat16).pack_weights() == "torch"
    if path_problem("avx2") is None:
        assert resolve_linear_kernel("avx2", torch.bfloat16, CPU) == "avx2"
    monkeypatch.setenv(LINEAR_ENV, "fast")
    with pytest.raises(ValueError, match=f"{LINEAR_ENV}=fast: linear kernel 'fast' is not one of"):
        resolve_linear_kernel("auto", torch.bfloat16, CPU)


def test_pack_layout_pads_and_interleaves_pairs():
    weight = torch.arange(70 * 5, dtype=torch.float32).view(70, 5).to(torch.bfloat16)  # N = 70, K = 5 (odd)
    packed = native.pack(weight)
    assert packed.shape == (2, 3, 64, 2)  # ceil(70/64) tiles, ceil(5/2) feature pairs
    assert torch.equal(packed[0, 1, 7], weight[7, 2:4])  # tile 0, pair 1, output 7 = features 2, 3
    assert torch.equal(packed[1, 2, 5], torch.stack([weight[69, 4], torch.tensor(0, dtype=torch.bfloat16)]))
    assert not packed[1, :, 6:].any()  # outputs 70.. are zero padding
    assert native.pack(weight, 32).shape == (3, 3, 32, 2)  # the avx2 build's tile


@pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)), reason="needs oneDNN bf16 on CPU")
def test_auto_falls_back_to_onednn_and_an_explicit_request_says_why(monkeypatch):
    monkeypatch.delenv(LINEAR_ENV, raising=False)
    monkeypatch.setattr(native, "_built", {name: (None, "the CPU lacks avx512_bf16") for name in native.BUILDS})
    model = varied_model(0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the avx2 kernel is unavailable: the CPU lacks avx512_bf16"):
        model.pack_weights("avx2")
    assert model.linear_kernel == "torch"  # nothing half-swapped
    assert model.pack_weights("auto") == "onednn"


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


@pytest.mark.parametrize("cpu,weights", [("old", "q4_1"), ("old", "q8_0")])
def test_a_block_format_on_a_cpu_without_our_kernels_is_refused_with_the_reason(monkeypatch, cpu, weights):
    _fake_cpu(monkeypatch, FLAGS[cpu])
    monkeypatch.delenv(LINEAR_ENV, raising=False)
    path = resolve_linear_kernel("auto", build.resolve_dtype("auto"), CPU)
    with pytest.raises(ValueError, match=f"--weights {weights} needs one of our kernels .* would run on torch"):
        build.check_weights(weights, path)
    build.check_weights("auto", path)  # auto means bf16 there
    with pytest.raises(ValueError, match="the projections of this model run on torch"):
        varied_model(0).pack_weights("auto", weights=weights)


@pytest.mark.parametrize("name", list(native.BUILDS))
def test_each_builds_tiles_are_what_the_packing_lays_out(name):
    """native.BUILDS' tile sizes and record sizes agree with what the compiled build reads."""
    if path_problem(name) is not None:
        pytest.skip(f"build {name} cannot run here: {path_problem(name)}")
    from specdecode.models.weights import FORMAT_CODES, BLOCK_FORMATS, pack, quantize

    ops, b = native.kernel(name), native.BUILDS[name]
    assert ops.tile_outputs() == b.tile and ops.quant_tile_outputs() == b.quant_tile
    for fmt in BLOCK_FORMATS:
        assert pack(quantize(torch.randn(3, 64), fmt), b.quant_tile).shape[-1] == ops.quant_record_bytes(FORMAT_CODES[fmt])
