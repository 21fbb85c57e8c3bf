"""Time of the projections of one forward, per kernel and row count (BENCHMARKS.md, "Runtime speed").

For each model geometry it builds random bf16 weights of every projection of every layer plus the output
head (so that, as in a real step, they stream from memory rather than sit in cache), then times one pass
through all of them with the same input rows on each kernel: the tiled kernel (``models/tiled.py``), the
pre-packed oneDNN one and, with ``--with-torch``, plain ``F.linear``. Attention, norms and the rest of a
step are not included; ``specdecode bench`` measures whole steps. Prints a table, then one JSON line.

    .venv/bin/python benchmarks/linear_kernels.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from specdecode.models import tiled
from specdecode.models.linear import PackedLinear, TiledLinear

# name: (layers, hidden, intermediate, query heads, kv heads, head dim, vocab)
GEOMETRIES = {"SmolLM2-135M": (30, 576, 1536, 9, 3, 64, 49152),
              "Qwen2.5-0.5B": (24, 896, 4864, 14, 2, 64, 151936),
              "Qwen2.5-1.5B": (28, 1536, 8960, 12, 2, 128, 151936)}


def projection_shapes(layers: int, hidden: int, inter: int, heads: int, kv_heads: int, dim: int,
                      vocab: int) -> list[tuple[int, int]]:
    """[out, in] of every projection of one forward, in order, the output head last."""
    block = [((heads + 2 * kv_heads) * dim, hidden), (hidden, heads * dim), (2 * inter, hidden), (hidden, inter)]
    return block * layers + [(vocab, hidden)]


def time_pass(layers: list, rows: int, repeats: int) -> float:
    """Median seconds of one pass through ``layers`` with ``rows`` input rows."""
    inputs = {}
    for layer in layers:
        k = layer.in_features
        inputs.setdefault(k, torch.randn(1, rows, k).to(torch.bfloat16))
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first pass warms up
            start = time.perf_counter()
            for layer in layers:
                layer(inputs[layer.in_features])
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


class _Plain(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight, (self.out_features, self.in_features) = weight, weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rows", default="1,2,3,5,8,16", help="comma-separated row counts")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--models", default=",".join(GEOMETRIES), help="comma-separated names of GEOMETRIES")
    parser.add_argument("--with-torch", action="store_true", help="also time plain F.linear (slow)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    reason = tiled.unavailable_reason(print)
    if reason:
        raise SystemExit(f"the tiled kernel is unavailable: {reason}")
    rows = [int(r) for r in args.rows.split(",")]
    results = {}
    print(f"{'model':14} {'rows':>4} {'MB':>6} " + " ".join(f"{k:>10}" for k in ["onednn ms", "tiled ms"])
          + (f" {'torch ms':>10}" if args.with_torch else "") + f" {'tiled vs onednn':>16} {'tiled GB/s':>10}")
    for name in args.models.split(","):
        shapes = projection_shapes(*GEOMETRIES[name])
        weights = [torch.randn(n, k).mul_(0.05).to(torch.bfloat16) for n, k in shapes]
        mbytes = sum(w.numel() * 2 for w in weights) / 1e6
        kernels = {"onednn": [PackedLinear(w) for w in weights], "tiled": [TiledLinear(w) for w in weights]}
        if args.with_torch:
            kernels["torch"] = [_Plain(w) for w in weights]
        del weights
        results[name] = {"weights_mb": round(mbytes, 1), "rows": {}}
        for r in rows:
            ms = {kind: time_pass(layers, r, args.repeats) * 1e3 for kind, layers in kernels.items()}
            ratio = ms["onednn"] / ms["tiled"]
            results[name]["rows"][r] = {**{f"{k}_ms": round(v, 2) for k, v in ms.items()},
                                        "tiled_speedup_vs_onednn": round(ratio, 3)}
            print(f"{name:14} {r:>4} {mbytes:>6.0f} {ms['onednn']:>10.2f} {ms['tiled']:>10.2f}"
                  + (f" {ms['torch']:>10.2f}" if args.with_torch else "")
                  + f" {ratio:>15.2f}x {mbytes / ms['tiled']:>10.1f}", flush=True)
        del kernels
    print(json.dumps({"threads": torch.get_num_threads(), "repeats": args.repeats, "results": results}))


if __name__ == "__main__":
    main()
