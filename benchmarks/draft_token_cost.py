"""What one drafted token of a draft model costs, per weight format and draft vocabulary, next to a target decode
step (docs/benchmarks/history.md, "A draft model that pays").

The target (``--model``) times a decode step (one row with its logits) after a ``--context``-token prompt; then
the draft model (``--draft-model``) is loaded once per ``--weights`` format and, for each draft vocabulary size
in ``--vocab`` (0 = all ids), drafts greedy chains of ``--gamma`` tokens after the same prompt through
``DraftModelDrafter`` (each chain rolled back), which counts its forward, its head and the pick. Rounds go
through every vocabulary in turn; medians of ``--rounds`` rounds, in milliseconds and as a share of the target's
step. Prints a table, then one JSON line. Not part of the test suite (timings).

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


def target_step_ms(name: str, prompt: list[int], rounds: int) -> float:
    """Median ms of one decode step of ``name`` after ``prompt``, the logits of its whole vocabulary included."""
    model = load_model(name).model
    cache = model.new_cache(CacheConfig(max_len=len(prompt) + 2))
    times = []
    with torch.inference_mode():
        model.forward_rows(torch.tensor(prompt), cache, (0,), (len(prompt),), logits=LogitRows.NONE)
        for _ in range(rounds):
            start = time.perf_counter()
            model.forward_rows(torch.tensor([prompt[-1]]), cache, (0,), (1,), logits=LogitRows.LAST).logits.argmax(-1)
            times.append(time.perf_counter() - start)
            cache.trim(0, len(prompt))
    return statistics.median(times) * 1e3


def drafted_token_ms(name: str, weights: str, sizes: list[int], prompt: list[int], gamma: int,
                     rounds: int) -> dict[int, float]:
    """Median ms per drafted token of ``name`` in ``weights``, per draft vocabulary size."""
    loaded = load_model(name, weights=weights)
    eos = loaded.tokenizer.eos_token_ids
    drafters = {n: DraftModelDrafter(loaded.model, vocab=draft_vocabulary(loaded.model, n, eos)) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    greedy, generator = SamplingParams(), torch.Generator()
    with torch.inference_mode():
        for drafter in drafters.values():
            drafter.reset(_TargetCache(), prompt)
        for _ in range(rounds):
            for n, drafter in drafters.items():
                start = time.perf_counter()
                drafter.propose(prompt, gamma, greedy, generator)
                times[n].append((time.perf_counter() - start) / gamma)
                drafter.commit(prompt)  # the chain rejected: back to the prompt
    return {n: statistics.median(t) * 1e3 for n, t in times.items()}


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
    sizes = [int(v) for v in args.vocab.split(",")]
    step = target_step_ms(args.model, prompt, args.rounds)
    rows = []
    print(f"{cpu_model()}, {args.threads} threads; {args.model} step {step:.2f} ms")
    print(f"{'draft weights':>14} {'vocab':>7} {'ms/token':>9} {'of a step':>9}")
    for weights in args.weights.split(","):
        for n, ms in drafted_token_ms(args.draft_model, weights, sizes, prompt, args.gamma, args.rounds).items():
            rows.append({"weights": weights, "vocab": n, "ms": ms, "of_step": ms / step})
            print(f"{weights:>14} {n:>7} {ms:>9.2f} {ms / step:>9.3f}", flush=True)
    print(json.dumps({"cpu": cpu_model(), "threads": args.threads, "model": args.model, "draft_model": args.draft_model,
                      "step_ms": step, "gamma": args.gamma, "rows": rows}))


if __name__ == "__main__":
    main()
