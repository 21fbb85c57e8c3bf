"""What the output head costs in a forward of k rows (docs/benchmarks/history.md, "Decided steps without the
output head").

On the real SmolLM2 (or ``--model``), after a ``--context``-token prompt in one slot of a batch engine's cache: a
forward of k rows (1..``--max-rows``) with the logits of every row, and the same without any, each rolled back.
Rounds go through every (k, head) pair in turn, so the machine's drift hits every cell alike; medians of
``--rounds`` rounds, relative to one row with its logits (a plain step). Prints a table, then one JSON line. Not
part of the test suite (timings).

    .venv/bin/python benchmarks/output_head_rows.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdecode.batch.executor import BatchEngine
from specdecode.models.native import cpu_model
from specdecode.models.rows import LogitRows
from specdecode.target import TargetConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--max-rows", type=int, default=8)
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = TargetConfig(args.model).load()
    model, engine = loaded.model, BatchEngine(loaded.model, loaded.tokenizer)
    times: dict[tuple[int, bool], list[float]] = {}
    context = [100 + i % 1000 for i in range(args.context)]
    with torch.inference_mode(), engine.timer.borrowed_slot(context, engine.scheduler.slots, busy=False) as slot:
        for _ in range(args.rounds):
            for rows in range(1, args.max_rows + 1):
                for head in (True, False):
                    held = engine.kv.cache.lengths[slot]
                    start = time.perf_counter()
                    out = model.forward_rows(torch.zeros(rows, dtype=torch.long), engine.kv.cache, (slot,), (rows,),
                                             logits=LogitRows.at(torch.arange(rows)) if head else LogitRows.NONE)
                    if head:
                        out.logits.argmax(-1)
                    times.setdefault((rows, head), []).append(time.perf_counter() - start)
                    engine.kv.cache.trim(slot, held)
    step = statistics.median(times[1, True])
    table = {rows: {head: statistics.median(times[rows, head]) / step for head in (True, False)}
             for rows in range(1, args.max_rows + 1)}
    print(f"{cpu_model()}, {args.model}, {args.threads} threads, {args.context}-token context; "
          f"one row with logits: {step * 1e3:.2f} ms")
    print(f"{'rows':>4}  {'with logits':>11}  {'without':>7}  {'head':>5}")
    for rows, cost in table.items():
        print(f"{rows:>4}  {cost[True]:>11.2f}  {cost[False]:>7.2f}  {cost[True] - cost[False]:>5.2f}")
    print(json.dumps({"cpu": cpu_model(), "model": args.model, "threads": args.threads, "context": args.context,
                      "step_ms": step * 1e3,
                      "rows": [{"rows": r, "with_logits": c[True], "without": c[False]} for r, c in table.items()]}))


if __name__ == "__main__":
    main()
