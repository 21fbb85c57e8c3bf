"""What one drafted token of a draft model costs, per weight format and draft vocabulary, next to a target decode
step (docs/benchmarks/history.md, "A draft model that pays").

The target (``--model``) and the draft model (``--draft-model``, once per ``--weights`` format) are loaded
together. Each round times a target decode step (one row with its logits) after a ``--context``-token prompt, then,
for each format and draft vocabulary size in ``--vocab`` (0 = all ids), greedy chains of ``--gamma`` tokens
drafted after the same prompt through ``DraftModelDrafter`` (each chain rolled back), which counts its forward,
its head and the pick. A drafted token's share of a step is taken within each round (a host whose memory speed
drifts moves both) and its median over ``--rounds`` rounds reported, with the median milliseconds. Prints a
table, then one JSON line. Not part of the test suite (timings).

    .venv/bin/python benchmarks/draft_token_cost.py --weights q4_1,q4_1+head --vocab 0,65536,32768
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdecode.drafters.draft_model import DraftModelDrafter, draft_vocabulary
from specdecode.kv.cache import CacheConfig
from specdecode.models.build import load_model
from specdecode.models.native import cpu_model
from specdecode.models.rows import LogitRows
from specdecode.sampling import SamplingParams


class _TargetCache:
    """What a draft model's drafter reads of the target's cache: how long a sequence may grow."""

    max_len = 4096


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--weights", default="q4_1,q4_1+head", help="comma list of the draft's --draft-weights")
    p.add_argument("--vocab", default="0,65536,32768", help="comma list of draft vocabulary sizes (0 = all)")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    prompt = [100 + i % 1000 for i in range(args.context)]
    target = load_model(args.model).model
    target_cache = target.new_cache(CacheConfig(max_len=len(prompt) + 2))
    drafters = {}
    for weights in args.weights.split(","):
        loaded = load_model(args.draft_model, weights=weights)
        eos = loaded.tokenizer.eos_token_ids
        for n in (int(v) for v in args.vocab.split(",")):
            drafters[(weights, n)] = DraftModelDrafter(loaded.model, vocab=draft_vocabulary(loaded.model, n, eos))
    steps: list[float] = []
    drafted: dict[tuple[str, int], list[float]] = {key: [] for key in drafters}
    greedy, generator = SamplingParams(), torch.Generator()
    with torch.inference_mode():
        target.forward_rows(torch.tensor(prompt), target_cache, (0,), (len(prompt),), logits=LogitRows.NONE)
        for drafter in drafters.values():
            drafter.reset(_TargetCache(), prompt)
        for _ in range(args.rounds):
            start = time.perf_counter()
            target.forward_rows(torch.tensor([prompt[-1]]), target_cache, (0,), (1,),
                                logits=LogitRows.LAST).logits.argmax(-1)
            steps.append(time.perf_counter() - start)
            target_cache.trim(0, len(prompt))
            for key, drafter in drafters.items():
                start = time.perf_counter()
                drafter.propose(prompt, args.gamma, greedy, generator)
                drafted[key].append((time.perf_counter() - start) / args.gamma)
                drafter.commit(prompt)  # the chain rejected: back to the prompt
    step = statistics.median(steps) * 1e3
    rows = []
    print(f"{cpu_model()}, {args.threads} threads; {args.model} step {step:.2f} ms (median of {args.rounds} rounds)")
    print(f"{'draft weights':>14} {'vocab':>7} {'ms/token':>9} {'of a step':>9}")
    for (weights, n), times in drafted.items():
        ms = statistics.median(times) * 1e3
        share = statistics.median(t / s for t, s in zip(times, steps))
        rows.append({"weights": weights, "vocab": n, "ms": ms, "of_step": share})
        print(f"{weights:>14} {n:>7} {ms:>9.2f} {share:>9.3f}")
    print(json.dumps({"cpu": cpu_model(), "threads": args.threads, "model": args.model, "draft_model": args.draft_model,
                      "step_ms": step, "gamma": args.gamma, "rows": rows}))


if __name__ == "__main__":
    main()
