"""Which backend runs (``backends/__init__.py``): "auto" following the CPU flags, a backend forced by name or by
``$SPECDECODE_LINEAR`` that cannot run here named with the reason, the fallback to oneDNN and torch, and block
formats refused where no backend computes them."""

from __future__ import annotations

import pytest
import torch

from specdecode.models import build, native
from specdecode.models.backends import BACKENDS, LINEAR_CHOICES, LINEAR_ENV, TORCH, resolve_backend
from specdecode.models.build import pack_model
from specdecode.models.linear import can_pack
from fake_cpu import FLAGS, fake_cpu
from kernel_paths import path_problem
from tiny_models import varied_model

CPU = torch.device("cpu")


def test_the_choices_are_auto_then_ours_then_onednn_then_torch():
    assert LINEAR_CHOICES == ("auto", *native.BUILDS, "onednn", "torch")
    assert all(BACKENDS[name].row_invariant and BACKENDS[name].block_formats for name in native.BUILDS)
    assert not BACKENDS["onednn"].row_invariant and not TORCH.row_invariant and not TORCH.packs


@pytest.mark.parametrize("cpu,dtype,path", [("zen4", torch.bfloat16, "tiled"), ("xeon-no-bf16", torch.bfloat16, "avx512"),
                                            ("skylake-sp", torch.bfloat16, "avx2"), ("zen2", torch.bfloat16, "avx2"),
                                            ("old", torch.float32, "torch")])
def test_auto_dtype_and_path_follow_the_cpu_flags(monkeypatch, cpu, dtype, path):
    fake_cpu(monkeypatch, FLAGS[cpu])
    monkeypatch.delenv(LINEAR_ENV, raising=False)
    assert build.resolve_dtype("auto") == dtype
    assert build.cpu_has_fast_bf16() == (cpu == "zen4")
    if dtype == torch.bfloat16:
        assert resolve_backend("auto", dtype, CPU).name == path
    else:
        assert resolve_backend("auto", dtype, CPU) is TORCH  # oneDNN packs bf16 only


@pytest.mark.parametrize("cpu,path,missing", [("xeon-no-bf16", "tiled", "avx512_bf16"),
                                              ("zen2", "avx512", "avx512_vnni, avx512bw, avx512f, avx512vl"),
                                              ("zen2", "tiled", "avx512_bf16, avx512_vnni, avx512bw, avx512f, avx512vl")])
def test_forcing_a_path_the_cpu_cannot_run_names_the_path_and_the_feature(monkeypatch, cpu, path, missing):
    fake_cpu(monkeypatch, FLAGS[cpu])
    with pytest.raises(ValueError, match=f"the {path} kernel is unavailable: the CPU lacks {missing}$"):
        resolve_backend(path, torch.bfloat16, CPU)
    monkeypatch.setenv(LINEAR_ENV, path)  # the same through the environment, which names itself
    with pytest.raises(ValueError, match=f"{LINEAR_ENV}={path}: the {path} kernel is unavailable: the CPU lacks"):
        resolve_backend("auto", torch.bfloat16, CPU)


def test_the_environment_forces_a_path_and_an_explicit_kernel_wins(monkeypatch):
    monkeypatch.setenv(LINEAR_ENV, "torch")
    assert resolve_backend("auto", torch.bfloat16, CPU) is TORCH
    assert pack_model(varied_model(0, dtype=torch.bfloat16)) is TORCH
    if path_problem("avx2") is None:
        assert resolve_backend("avx2", torch.bfloat16, CPU) is BACKENDS["avx2"]
    monkeypatch.setenv(LINEAR_ENV, "fast")
    with pytest.raises(ValueError, match=f"{LINEAR_ENV}=fast: linear kernel 'fast' is not one of"):
        resolve_backend("auto", torch.bfloat16, CPU)


@pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)), reason="needs oneDNN bf16 on CPU")
def test_auto_falls_back_to_onednn_and_an_explicit_request_says_why(monkeypatch):
    monkeypatch.delenv(LINEAR_ENV, raising=False)
    monkeypatch.setattr(native, "_built", {name: (None, "the CPU lacks avx512_bf16") for name in native.BUILDS})
    model = varied_model(0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the avx2 kernel is unavailable: the CPU lacks avx512_bf16"):
        pack_model(model, "avx2")
    assert model.backend is TORCH and model.head_layer is None  # nothing half-swapped
    assert pack_model(model, "auto").name == "onednn"


@pytest.mark.parametrize("cpu,weights", [("old", "q4_1"), ("old", "q8_0")])
def test_a_block_format_on_a_cpu_without_our_kernels_is_refused_with_the_reason(monkeypatch, cpu, weights):
    fake_cpu(monkeypatch, FLAGS[cpu])
    monkeypatch.delenv(LINEAR_ENV, raising=False)
    backend = resolve_backend("auto", build.resolve_dtype("auto"), CPU)
    with pytest.raises(ValueError, match=f"--weights {weights} needs one of our kernels .* would run on torch"):
        build.check_weights(weights, backend)
    build.check_weights("auto", backend)  # auto means bf16 there
    with pytest.raises(ValueError, match="the projections of this model run on torch"):
        pack_model(varied_model(0), "auto", weights=weights)
