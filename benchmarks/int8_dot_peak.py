"""The int8 dot-product peak of one core: how many 512-bit ``vpdpbusd`` (AVX512-VNNI) a core retires per second,
or on an AVX2-only CPU 256-bit ``vpmaddubsw`` + ``vpmaddwd`` pairs (what our block kernels issue per 4 inputs).

A compute floor for verification rows (docs/benchmarks/history.md, "The next tile prefetched into L2"): a row
of a model with W weights needs at least W / (lanes x 4) of these per row, spread over the threads. Compiles a loop
of 12 independent accumulators with the system's C++ compiler and times it on one thread; prints the rate, then
one JSON line. Not part of the test suite (timings).

    .venv/bin/python benchmarks/int8_dot_peak.py --weights 1.54e9 --threads 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from specdecode.models.native import cpu_flags, cpu_model

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
int main() {
  const long n = 100000000;
#ifdef VNNI
  __m512i acc[12], w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
  for (int i = 0; i < 12; i++) acc[i] = _mm512_setzero_si512();
#else
  __m256i acc[12], w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5), ones = _mm256_set1_epi16(1);
  for (int i = 0; i < 12; i++) acc[i] = _mm256_setzero_si256();
#endif
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long k = 0; k < n; k++) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; i++) {
      __asm__ volatile("" : "+v"(w));  // w may change: no product is computed once for all accumulators
#ifdef VNNI
      acc[i] = _mm512_dpbusd_epi32(acc[i], w, x);
#else
      acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
#endif
    }
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  long sum = 0;
  for (int i = 0; i < 12; i++) {
    int lanes[16];
#ifdef VNNI
    _mm512_storeu_si512(lanes, acc[i]);
#else
    _mm256_storeu_si256((__m256i*)lanes, acc[i]);
#endif
    sum += lanes[0];
  }
  printf("%.6f %ld\n", (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec), sum);
  return 0;
}
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", type=float, default=1.54e9, help="a model's weights, for the per-row floor")
    p.add_argument("--threads", type=int, default=2, help="cores a row's dot products are spread over")
    args = p.parse_args()
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise SystemExit("no C++ compiler on PATH")
    vnni = {"avx512f", "avx512bw", "avx512_vnni"} <= cpu_flags()
    flags = ["-mavx512f", "-mavx512bw", "-mavx512vnni", "-DVNNI"] if vnni else ["-mavx2"]
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        src.write_text(SOURCE)
        subprocess.run([compiler, "-O2", *flags, str(src), "-o", str(exe)], check=True)
        seconds = float(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()[0])
    per_s = 100_000_000 * 12 / seconds  # instructions (VNNI) or pairs (AVX2) per second, one core
    macs = 64 if vnni else 32  # int8 products per instruction (pair)
    floor_ms = args.weights / macs / (per_s * args.threads) * 1e3
    what = "512-bit vpdpbusd" if vnni else "256-bit vpmaddubsw + vpmaddwd pairs"
    print(f"{cpu_model()}: {per_s / 1e9:.3f} G {what} / s per core ({per_s * macs / 1e9:.0f} G int8 products / s)")
    print(f"a row of {args.weights:.3g} weights: >= {floor_ms:.2f} ms of dot products on {args.threads} cores")
    print(json.dumps({"cpu": cpu_model(), "vnni": vnni, "per_core_per_s": per_s, "products_per_instruction": macs,
                      "weights": args.weights, "threads": args.threads, "row_floor_ms": floor_ms}))


if __name__ == "__main__":
    main()
