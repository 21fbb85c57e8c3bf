"""The library's n-gram speculation under load, without a server: ``BatchEngine.run`` of the bench's chat
prompts at most ``--level`` at a time, with ``--threads`` kernel threads, every method in turn per round.

It prints a table (median tokens/s, the median of per-round ratios to plain decoding, each round's ratio)
and one JSON line. It does not start a server (``specdecode bench-serve`` does, and runs the library beside
it); this separates what the engine gains under load from what a server's conditions take away. With
``--fresh`` every round of every method gets a new engine: drafters that learn across requests (``suffix``,
``auto``) start cold each round, as on a fresh server.

    python benchmarks/library_ngram_load.py --threads 1 --level 4 --rounds 3 --methods none,ngram:adaptive,ngram:2
    python benchmarks/library_ngram_load.py --threads 2 --level 8 --rounds 7 --limit 10 --fresh \
        --methods none,ngram:adaptive,auto:adaptive
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from specdecode.bench.library import Library
from specdecode.bench.prompts import default_prompts, select
from specdecode.models.native import cpu_model
from specdecode.target import TargetConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--level", type=int, default=4, help="requests running at once")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--methods", default="none,ngram:adaptive", help="comma-separated, plain (none) first")
    p.add_argument("--limit", type=int, default=1, help="prompts per category of the chat suites")
    p.add_argument("--fresh", action="store_true", help="a new engine per round and method (learners cold)")
    args = p.parse_args()
    methods = args.methods.split(",")
    if methods[0] != "none":
        p.error("--methods must start with none (the ratios' reference)")
    torch.set_num_threads(args.threads)
    lib = Library(TargetConfig(args.model), lambda _line: None)
    prompts = select(default_prompts(), limit=args.limit)
    requests = lib.requests(prompts, max(len(prompts), 2 * args.level))
    speeds: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(args.rounds):
        for m in methods:  # interleaved: each round's ratios share the machine's state of that moment
            speeds[m].append(lib.tokens_per_s(m, args.level, requests, args.max_tokens, fresh=args.fresh)[0])
    rows = []
    print(f"{cpu_model()}, {args.model}, {args.threads} thread(s), {args.level} at a time, {len(requests)} requests"
          f"{', a fresh engine each' if args.fresh else ''}")
    print(f"{'method':24s} {'tok/s':>7s} {'vs none':>8s}  rounds")
    for m in methods:
        ratios = [a / b for a, b in zip(speeds[m], speeds["none"])]
        rows.append({"method": m, "tokens_per_s": statistics.median(speeds[m]), "vs_none": statistics.median(ratios),
                     "rounds": ratios})
        print(f"{m:24s} {rows[-1]['tokens_per_s']:7.1f} {rows[-1]['vs_none']:8.3f}  {[round(r, 2) for r in ratios]}")
    print(json.dumps({"cpu": cpu_model(), "model": args.model, "threads": args.threads, "level": args.level,
                      "requests": len(requests), "fresh": args.fresh, "rows": rows}))


if __name__ == "__main__":
    main()
