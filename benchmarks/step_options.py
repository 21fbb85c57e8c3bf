"""How a decode step is run, measured side by side (docs/benchmarks/history.md, "Weights as stored and a fused step").

Three ways to run the same packed model, each with bf16 weights and with a block format, on the real
SmolLM2 (or ``--model``), interleaved call by call:

- ``eager``: one torch op per step of each layer (``pack_model(fuse=False)``), our kernels for the
  projections and attention;
- ``compiled``: the same layers with their glue (norms, RoPE, residuals, SiLU) compiled by ``torch.compile``,
  our projection kernels registered as custom ops (``torch.library``) so that inductor can trace around
  them; attention and the cache write stay eager;
- ``fused``: each layer one C++ call (``kernels/layer.h``), what ``pack_model`` does by default.

Each row times one forward of ``rows`` new tokens after a 200-token prompt (median of ``--repeats``), at
``--threads``. Prints a table, then one JSON line. It is not part of the test suite (timings).

    .venv/bin/python benchmarks/step_options.py --threads 1,2 --weights bf16,q4_1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Optional

import torch

from specdecode.kv.cache import CacheConfig
from specdecode.models.block import Block
from specdecode.models.build import from_hf_tensors, pack_model
from specdecode.models.linear import SplitLinear
from specdecode.models.loader import load_checkpoint
from specdecode.models.native import cpu_model
from specdecode.models.rows import LogitRows
from specdecode.models.weights import FORMAT_CODES


@torch.library.custom_op("specdecode_bench::linear", mutates_args=())
def _linear(x: torch.Tensor, packed: torch.Tensor, n_out: int, bias: Optional[torch.Tensor], fmt: int,
            path: str) -> torch.Tensor:
    from specdecode.models import native

    ops = native.kernel(path)
    if fmt == FORMAT_CODES["bf16"]:
        return getattr(ops, native.BUILDS[path].bf16_linear)(x, packed, n_out, bias)
    return ops.quant_linear(x, packed, fmt, n_out, bias)


@_linear.register_fake
def _(x, packed, n_out, bias, fmt, path):
    return x.new_empty(*x.shape[:-1], n_out)


class _Op(torch.nn.Module):
    """A packed projection called through the custom op (what dynamo can trace)."""

    def __init__(self, layer) -> None:
        super().__init__()
        self.layer = layer
        self.fmt = FORMAT_CODES[layer.weight_format]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.layer.packed, self.layer.out_features, self.layer.bias, self.fmt, self.layer.path)


class _Parts(torch.nn.Module):
    """A projection of parts in formats of their own (``SplitLinear``) as its parts' custom-op calls, joined."""

    def __init__(self, layer) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(_Op(part) for part in layer.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def _compile_glue(model) -> None:
    """Swaps each block's projections for custom-op calls and compiles its qkv and finish steps."""
    for block in model.layers:
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            layer = getattr(block, name)
            setattr(block, name, _Parts(layer) if isinstance(layer, SplitLinear) else _Op(layer))
        block.qkv = torch.compile(Block.qkv.__get__(block), dynamic=True, fullgraph=True)
        block.finish = torch.compile(Block.finish.__get__(block), dynamic=True, fullgraph=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--weights", default="bf16,q4_1")
    p.add_argument("--rows", default="1,4")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--options", default="eager,compiled,fused")
    args = p.parse_args()
    ckpt = load_checkpoint(args.model)
    options = args.options.split(",")
    models = {}
    for weights in args.weights.split(","):
        for option in options:
            m = from_hf_tensors(ckpt.config, ckpt.tensors, dtype=torch.bfloat16)
            pack_model(m, "auto", weights=weights, source=ckpt.weights, fuse=option == "fused")
            if option == "compiled":
                _compile_glue(m)
            cache = m.new_cache(CacheConfig(max_len=512))
            with torch.inference_mode():
                m(torch.randint(0, 1000, (1, 200)), cache, logits=LogitRows.NONE, invariant_rows=True)
            models[(weights, option)] = (m, cache)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        times: dict[tuple, list[float]] = {}
        with torch.inference_mode():
            for rep in range(args.repeats + 3):  # the first three warm up (and compile, once per shape)
                for key, (m, cache) in models.items():
                    for rows in rows_list:
                        start = cache.lengths[0]
                        t0 = time.perf_counter()
                        m(torch.randint(0, 1000, (1, rows)), cache, invariant_rows=True)
                        dt = time.perf_counter() - t0
                        cache.trim(0, start)
                        if rep >= 3:
                            times.setdefault((*key, rows), []).append(dt)
        for (weights, option, rows), ts in times.items():
            results.append({"threads": threads, "weights": weights, "option": option, "rows": rows,
                            "ms": round(statistics.median(ts) * 1e3, 3)})
    print(f"{cpu_model()}, {args.model}, one forward of `rows` new tokens after 200, median of {args.repeats}")
    print(f"{'threads':>7} {'weights':>7} {'rows':>4} " + " ".join(f"{o:>10}" for o in options))
    for threads in sorted({r["threads"] for r in results}):
        for weights in args.weights.split(","):
            for rows in rows_list:
                cells = [next(r["ms"] for r in results if (r["threads"], r["weights"], r["option"], r["rows"])
                              == (threads, weights, o, rows)) for o in options]
                print(f"{threads:>7} {weights:>7} {rows:>4} " + " ".join(f"{c:>8.2f}ms" for c in cells))
    print(json.dumps({"cpu": cpu_model(), "model": args.model, "results": results}))


if __name__ == "__main__":
    main()
