"""K-quants as stored against the 32-weight block formats, one projection shape streamed from memory.

For each pair FMT:OTHER (e.g. q6_k:q8_0), six random [N, K] projections in each format (more bytes than the
caches hold), called in interleaved rounds with the same rows of x; the median of the per-round time ratios.
The K-quants get random well-formed blocks (as tests/models/tiny_gguf.py writes them), the block formats the
reference quantizer's blocks of random weights: the values differ, the work does not.

    .venv/bin/python benchmarks/kquant_projections.py --pairs q4_k:q4_1,q5_k:q8_0,q6_k:q8_0 --rows 1,4,8

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from specdecode.models.linear import QuantLinear
from specdecode.models.native import cpu_model
from specdecode.models.super_blocks import SUPER_QTYPES, from_gguf
from specdecode.models.weights import quantize

_BYTES = {"q4_k": (144, [0, 2]), "q5_k": (176, [0, 2]), "q6_k": (210, [208])}  # block size, fp16 fields


def stored_blocks(fmt: str, n: int, k: int, seed: int):
    """Random well-formed K-quant blocks with small finite fp16 scales."""
    size, halves = _BYTES[fmt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n * k // 256, size), dtype=np.uint8)
    for at in halves:
        raw[:, at:at + 2] = (rng.random(len(raw)) * 0.02).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return from_gguf(raw, SUPER_QTYPES[fmt], (n, k))


def layers(fmt: str, n: int, k: int, count: int, path: str) -> list[QuantLinear]:
    made = []
    for i in range(count):
        blocks = stored_blocks(fmt, n, k, i) if fmt in SUPER_QTYPES else quantize(torch.randn(n, k) * 0.02, fmt)
        made.append(QuantLinear(blocks, None, path))
    return made


@torch.inference_mode()
def seconds(projections: list[QuantLinear], x: torch.Tensor) -> float:
    start = time.perf_counter()
    for p in projections:
        p(x)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", default="q4_k:q4_1,q5_k:q8_0,q6_k:q8_0")
    p.add_argument("--rows", default="1,4,8")
    p.add_argument("--shape", default="17920x1536", help="N x K of each projection (K a multiple of 256)")
    p.add_argument("--count", type=int, default=6, help="projections per format")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--path", default="tiled", help="our kernel build (tiled, avx512, avx2)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n, k = (int(v) for v in args.shape.split("x"))
    out = []
    print(f"{'pair':>12} {'rows':>4} {'ms':>8} {'other ms':>9} {'time ratio':>10} {'bytes ratio':>11}")
    for pair in args.pairs.split(","):
        fmt, other = pair.split(":")
        mine, theirs = layers(fmt, n, k, args.count, args.path), layers(other, n, k, args.count, args.path)
        size = sum(m.packed.numel() for m in mine) / sum(t.packed.numel() for t in theirs)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            seconds(mine, x), seconds(theirs, x)
            a, b = [], []
            for _ in range(args.rounds):
                a.append(seconds(mine, x))
                b.append(seconds(theirs, x))
            ratio = statistics.median(u / v for u, v in zip(a, b))
            row = {"format": fmt, "other": other, "rows": rows, "ms": statistics.median(a) * 1e3,
                   "other_ms": statistics.median(b) * 1e3, "time_ratio": ratio, "bytes_ratio": size}
            out.append(row)
            print(f"{pair:>12} {rows:>4} {row['ms']:8.2f} {row['other_ms']:9.2f} {ratio:10.3f} {size:11.3f}")
    print(json.dumps({"cpu": cpu_model(), "threads": args.threads, "path": args.path, "shape": args.shape,
                      "rows": out}))


if __name__ == "__main__":
    main()
