"""The CPU families this project meets, as /proc/cpuinfo flags, and a way to make ``models/native.py`` judge our
kernel builds as if this machine were one of them (nothing is compiled)."""

from __future__ import annotations

from specdecode.models import native

FLAGS = {  # what /proc/cpuinfo shows on the CPU families this project meets
    "zen4": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"},
    "xeon-no-bf16": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
    "skylake-sp": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"},
    "zen2": {"avx2", "fma", "f16c"},
    "old": {"sse4_2", "avx"},
}


def fake_cpu(monkeypatch, flags: set[str]) -> None:
    """This machine as an x86-64 CPU with ``flags``: builds it lacks are unavailable, the others stubbed in."""
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(native, "_built", {})  # judged anew (nothing is compiled: see the stub below)
    monkeypatch.setattr(native, "_build", lambda name, log: (None, native._static_reason(name))
                        if native._static_reason(name) else (object(), None))
