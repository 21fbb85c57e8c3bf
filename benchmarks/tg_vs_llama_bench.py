"""Plain token generation (or prefill), ours against llama.cpp's own `llama-bench` on the same GGUF and threads,
side by side in one run: llama-bench's tg N (its mean over `-r` runs of N tokens from an empty context) and ours
the same way (N greedy decode steps after a one-token prompt, no end-of-sequence stop, the median of the same
number of runs), rounds interleaved. With ``--prefill N``: llama-bench's pp N (an N-token prompt into an empty
context) and ours (the same N random tokens in one forward of N rows, the last row's logits only).

    python benchmarks/tg_vs_llama_bench.py --model smollm2-135m-instruct --tokens 128 --rounds 3
    python benchmarks/tg_vs_llama_bench.py --model qwen2.5-coder-1.5b-instruct --tokens 64 --rounds 3
    python benchmarks/tg_vs_llama_bench.py --model qwen2.5-coder-1.5b-instruct --prefill 512 --rounds 3

Needs the peers (`specdecode peers build`). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch

from specdecode.bench.llamacpp_tools import require
from specdecode.kv.cache import CacheConfig
from specdecode.models.build import load_model
from specdecode.models.fetch import fetch
from specdecode.models.registry import UnknownModelError, get
from specdecode.models.rows import LogitRows


def llama_bench(binary: str, gguf: str, threads: int, tokens: int, runs: int, prefill: int = 0) -> float:
    """llama-bench's tg tokens/s (its own average over ``runs``), or its pp tokens/s with ``prefill``."""
    prompt, generated = (prefill, 0) if prefill else (0, tokens)
    out = subprocess.run([binary, "-m", gguf, "-t", str(threads), "-p", str(prompt), "-n", str(generated),
                          "-r", str(runs), "-o", "json"], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


@torch.inference_mode()
def ours(model, tokens: int) -> float:
    """Our tokens/s over ``tokens`` greedy decode steps after a one-token prompt (one sequence, 2 threads)."""
    cache = model.new_cache(CacheConfig(max_len=tokens + 16))
    token = torch.tensor([1])
    model.forward_rows(token, cache, (0,), (1,), logits=LogitRows.LAST)  # the prompt
    start = time.perf_counter()
    for _ in range(tokens):
        logits = model.forward_rows(token, cache, (0,), (1,), logits=LogitRows.LAST).logits
        token = logits.argmax(-1)
    return tokens / (time.perf_counter() - start)


@torch.inference_mode()
def ours_prefill(model, tokens: int) -> float:
    """Our prompt tokens/s: ``tokens`` random ids into an empty cache in one forward (one sequence)."""
    cache = model.new_cache(CacheConfig(max_len=tokens + 16))
    prompt = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    model.forward_rows(prompt, cache, (0,), (tokens,), logits=LogitRows.LAST)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--weights", default="auto", help="our weight format (--weights of generate)")
    p.add_argument("--prefill", type=int, default=0, metavar="N",
                   help="compare prefill of an N-token prompt (llama-bench's pp N) instead of generation")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    try:
        gguf = str(fetch(get(args.model)))
    except UnknownModelError:
        gguf = args.model
    binary = str(require("llama-bench"))
    model = load_model(gguf, weights=args.weights).model
    run = (lambda: ours_prefill(model, args.prefill)) if args.prefill else (lambda: ours(model, args.tokens))
    run()  # one-time costs out of the rounds
    rows = []
    for _ in range(args.rounds):
        theirs = llama_bench(binary, gguf, args.threads, args.tokens, 3, args.prefill)
        mine = statistics.median(run() for _ in range(3))
        rows.append({"ours": mine, "llama_bench": theirs, "ratio": mine / theirs})
    ratio = statistics.median(r["ratio"] for r in rows)
    print(f"{'round':>5} {'ours tok/s':>11} {'llama-bench':>12} {'ratio':>6}")
    for i, r in enumerate(rows):
        print(f"{i:5d} {r['ours']:11.1f} {r['llama_bench']:12.1f} {r['ratio']:6.2f}")
    test = f"pp{args.prefill}" if args.prefill else f"tg{args.tokens}"
    print(f"median ratio {ratio:.2f} ({model.weight_format} on {model.backend.name}, {args.threads} threads, {test})")
    print(json.dumps({"model": args.model, "test": test, "tokens": args.prefill or args.tokens, "threads": args.threads,
                      "rounds": rows,
                      "median_ratio": ratio, "weights": model.weight_format, "kernel": model.backend.name}))


if __name__ == "__main__":
    main()
