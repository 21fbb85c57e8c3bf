"""The verification cost curve v(k) of one model alone: a forward over k drafted tokens, in decode steps.

The same measurement as `specdecode bench --cost-curve K` (bench/costs.py: sizes interleaved, medians), without
running the bench's prompts, at the context of a fixed code prompt (``--context N``: repeated to N tokens; each
verified row attends over the context, so rows cost more at long contexts). v(k) moves with the machine's memory
speed (a decode step streams every weight, a long verification computes), so compare curves taken side by side.

    .venv/bin/python benchmarks/cost_curve.py --model qwen2.5-coder-1.5b-instruct --max-k 16 --repeats 5
    .venv/bin/python benchmarks/cost_curve.py --context 1000

Prints the curve, then one JSON line.
"""

from __future__ import annotations

import argparse
import json

import torch

from specdecode.bench.costs import measure_cost_curve
from specdecode.models.build import load_model

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n' * 6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--weights", default="auto", help="our weight format (--weights of generate)")
    p.add_argument("--max-k", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=0, help="tokens of context (0: the prompt's own, ~130)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, weights=args.weights)  # a registered name, a .gguf path, ...
    ids = model.tokenizer.encode(PROMPT)
    if args.context:
        ids = (ids * (args.context // len(ids) + 1))[:args.context]
    curve = measure_cost_curve(model, ids, max_k=args.max_k, repeats=args.repeats)
    print(f"{args.model} ({model.model.weight_format}, {args.threads} threads), context {curve.context}, "
          f"step {curve.step_s * 1e3:.2f} ms")
    print("k " + " ".join(f"{k:5d}" for k in range(len(curve.seconds))))
    print("v " + " ".join(f"{v:5.2f}" for v in curve.relative))
    print(json.dumps({**curve.to_dict(), "threads": args.threads, "weights": model.model.weight_format}))


if __name__ == "__main__":
    main()
