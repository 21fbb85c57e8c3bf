"""Time of the projections of one forward, per kernel and row count (docs/benchmarks/history.md, "Runtime speed").

For each model geometry it builds random bf16 weights of every projection of every layer plus the output
head (so that, as in a real step, they stream from memory rather than sit in cache), then times one pass
through all of them with the same input rows on each kernel path that runs on this CPU: ours (tiled,
avx512, avx2; ``models/native.py``), the pre-packed oneDNN one and, with ``--with-torch``, plain
``F.linear`` (fp32 weights with ``--torch-float32``: what a CPU without our kernels would run). Attention, norms and the rest of a
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

from specdecode.models.backends import backend_problem
from specdecode.models.linear import NativeLinear, PackedLinear
from specdecode.models.native import BUILDS, cpu_model

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
        inputs.setdefault(k, torch.randn(1, rows, k).to(layer.dtype))
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
        self.dtype = weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rows", default="1,2,3,5,8,16", help="comma-separated row counts")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--models", default=",".join(GEOMETRIES), help="comma-separated names of GEOMETRIES")
    parser.add_argument("--with-torch", action="store_true", help="also time plain F.linear (slow)")
    parser.add_argument("--torch-float32", action="store_true", help="F.linear on float32 weights (with --with-torch)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    paths = [p for p in (*BUILDS, "onednn") if backend_problem(p, torch.bfloat16, cpu, print) is None]
    for p in (*BUILDS, "onednn"):
        if p not in paths:
            print(f"# {p}: {backend_problem(p, torch.bfloat16, cpu)}")
    if args.with_torch:
        paths.append("torch")
    if len(paths) < 1:
        raise SystemExit("no kernel path runs here")
    rows = [int(r) for r in args.rows.split(",")]
    results = {}
    print(f"# {cpu_model()}, {torch.get_num_threads()} threads")
    print(f"{'model':14} {'rows':>4} {'MB':>6} " + " ".join(f"{p + ' ms':>12}" for p in paths)
          + f" {paths[0] + ' GB/s':>12}")
    for name in args.models.split(","):
        shapes = projection_shapes(*GEOMETRIES[name])
        weights = [torch.randn(n, k).mul_(0.05).to(torch.bfloat16) for n, k in shapes]
        mbytes = sum(w.numel() * 2 for w in weights) / 1e6
        kernels = {p: [_make(p, w, args.torch_float32) for w in weights] for p in paths}
        del weights
        results[name] = {"weights_mb": round(mbytes, 1), "rows": {}}
        for r in rows:
            ms = {kind: time_pass(layers, r, args.repeats) * 1e3 for kind, layers in kernels.items()}
            results[name]["rows"][r] = {f"{k}_ms": round(v, 2) for k, v in ms.items()}
            print(f"{name:14} {r:>4} {mbytes:>6.0f} " + " ".join(f"{ms[p]:>12.2f}" for p in paths)
                  + f" {mbytes / ms[paths[0]]:>12.1f}", flush=True)
        del kernels
    print(json.dumps({"cpu": cpu_model(), "threads": torch.get_num_threads(), "repeats": args.repeats,
                      "torch_dtype": "float32" if args.torch_float32 else "bfloat16", "results": results}))


def _make(path: str, weight: torch.Tensor, torch_float32: bool) -> torch.nn.Module:
    if path in BUILDS:
        layer = NativeLinear(weight, None, path)
    elif path == "onednn":
        layer = PackedLinear(weight)
    else:
        return _Plain(weight.float() if torch_float32 else weight)
    layer.dtype = torch.bfloat16
    return layer


if __name__ == "__main__":
    main()
