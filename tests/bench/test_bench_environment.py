"""What a bench result records about the machine, and the dtype the transformers peers run in."""

from __future__ import annotations

import pytest
import torch

from specdecode.bench import runner
from specdecode.bench.runner import RELEVANT_CPU_FLAGS, environment, peer_dtype


@pytest.mark.parametrize("flags, relevant, family", [
    ({"sse4_2", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16"},
     ["amx_bf16", "avx2", "avx512_bf16", "avx512bw", "avx512f", "avx512vl", "f16c", "fma"], "x86-64 AVX512-BF16"),
    ({"avx2", "fma", "avx512f", "avx512_vnni", "ht"}, ["avx2", "avx512_vnni", "avx512f", "fma"],
     "x86-64 AVX512F (no BF16)"),
    ({"avx2", "avx_vnni", "sse2"}, ["avx2", "avx_vnni"], "x86-64 AVX2"),
])
def test_environment_records_the_relevant_cpu_flags_and_a_family_that_fits_them(monkeypatch, flags, relevant, family):
    monkeypatch.setattr(runner, "cpu_flags", lambda: frozenset(flags))
    env = environment()
    assert env["cpu_flags"] == relevant and env["cpu_family"] == family
    assert isinstance(env["cpu_model"], str) and env["cpu_model"]


def test_without_x86_flags_the_family_is_the_machine(monkeypatch):
    monkeypatch.setattr(runner, "cpu_flags", lambda: frozenset())
    monkeypatch.setattr(runner.platform, "machine", lambda: "aarch64")
    env = environment()
    assert env["cpu_flags"] == [] and env["cpu_family"] == "aarch64"


def test_this_machines_record_is_consistent():
    env = environment()
    assert set(env["cpu_flags"]) <= set(RELEVANT_CPU_FLAGS) and env["cpu_flags"] == sorted(env["cpu_flags"])
    if "avx512_bf16" in env["cpu_flags"]:
        assert env["cpu_family"] == "x86-64 AVX512-BF16"
    elif "avx512f" in env["cpu_flags"]:
        assert env["cpu_family"] == "x86-64 AVX512F (no BF16)"
    elif "avx2" in env["cpu_flags"]:
        assert env["cpu_family"] == "x86-64 AVX2"


@pytest.mark.parametrize("fast_bf16, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_under_auto_peers_run_bf16_only_where_the_cpu_has_native_bf16(monkeypatch, fast_bf16, expected):
    monkeypatch.setattr(runner, "cpu_has_fast_bf16", lambda: fast_bf16)
    assert peer_dtype("auto", torch.bfloat16) == expected  # ours runs bf16 on any AVX2 CPU


@pytest.mark.parametrize("fast_bf16", [True, False])
@pytest.mark.parametrize("requested, ours", [("bfloat16", torch.bfloat16), ("float32", torch.float32),
                                             ("float16", torch.float16)])
def test_an_explicit_dtype_applies_to_the_peers_too(monkeypatch, fast_bf16, requested, ours):
    monkeypatch.setattr(runner, "cpu_has_fast_bf16", lambda: fast_bf16)
    assert peer_dtype(requested, ours) == ours
