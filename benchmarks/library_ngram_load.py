"""The library's n-gram speculation under load, without a server: ``BatchEngine.run`` of the bench's chat
prompts at most ``--level`` at a time, with ``--threads`` kernel threads, every method in turn per round.

It prints a table (median tokens/s, the median of per-round ratios to plain decoding, each round's ratio)
and one JSON line. With ``--modeled`` it also times every step, and gives each method's runs as they would
have taken had every step of a given number of forward rows cost the same: the median over all methods' and
rounds' steps of that many rows (planning left out), plus the run's own planning time. This takes the
machine's drift out of the comparison and leaves what a method changes: its steps' rows and its planning
(not the rows' context lengths, nor its effect on the kernel's caches). It does not start a server
(``specdecode bench-serve`` does, and runs the library beside it); this separates what the engine gains under
load from what a server's conditions take away. With ``--fresh`` every round of every method gets a new engine:
drafters that learn across requests (``suffix``, ``auto``) start cold each round, as on a fresh server; with
``--stored-prompts`` its prompts are in its prefix cache first, as in bench-serve's servers.

    python benchmarks/library_ngram_load.py --threads 1 --level 4 --rounds 3 --methods none,ngram:adaptive,ngram:2
    python benchmarks/library_ngram_load.py --threads 2 --level 8 --rounds 7 --limit 10 --fresh \
        --methods none,ngram:adaptive,auto:adaptive
    python benchmarks/library_ngram_load.py --threads 2 --level 8 --rounds 3 --limit 10 --fresh --modeled \
        --stored-prompts --methods none,auto:adaptive
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdecode.batch.executor import BatchEngine
from specdecode.bench.library import Library
from specdecode.bench.prompts import default_prompts, select
from specdecode.models.native import cpu_model
from specdecode.target import TargetConfig


class StepLog:
    """Every step of every engine while installed: its forward rows, its seconds and its planning seconds."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, float, float]] = []
        self._step = BatchEngine.step

    def install(self) -> None:
        log, step = self, self._step

        def timed(engine: BatchEngine) -> None:
            plan, seen = engine.proposer.plan, {}

            def planned(running):  # (a plan's rows: fed tokens, prompt rows and drafts)
                tick = time.perf_counter()
                made = plan(running)
                seen.update(rows=made.rows, plan_s=time.perf_counter() - tick)
                return made
            engine.proposer.plan = planned
            tick = time.perf_counter()
            try:
                step(engine)
            finally:
                del engine.proposer.plan
            if seen:  # (a step with nothing running plans nothing)
                log.steps.append((seen["rows"], time.perf_counter() - tick - seen["plan_s"], seen["plan_s"]))
        BatchEngine.step = timed

    def take(self) -> list[tuple[int, float, float]]:
        steps, self.steps = self.steps, []
        return steps


def modeled(runs: dict[str, list[list[tuple[int, float, float]]]]) -> dict[str, list[float]]:
    """Per method, each run's seconds with every step costing the median of all steps with its rows, plus the run's
    own planning."""
    by_rows: dict[int, list[float]] = {}
    for steps in (s for method_runs in runs.values() for s in method_runs):
        for rows, seconds, _plan in steps:
            by_rows.setdefault(rows, []).append(seconds)
    cost = {rows: statistics.median(v) for rows, v in by_rows.items()}
    return {m: [sum(cost[rows] + plan for rows, _s, plan in steps) for steps in method_runs]
            for m, method_runs in runs.items()}


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
    p.add_argument("--modeled", action="store_true", help="also the runs with each step's cost by its rows")
    p.add_argument("--stored-prompts", action="store_true",
                   help="each run's engine first serves every request for one token, untimed (as bench-serve's "
                        "servers): the timed run reads the prompts from its prefix cache")
    args = p.parse_args()
    methods = args.methods.split(",")
    if methods[0] != "none":
        p.error("--methods must start with none (the ratios' reference)")
    torch.set_num_threads(args.threads)
    lib = Library(TargetConfig(args.model), lambda _line: None)
    prompts = select(default_prompts(), limit=args.limit)
    requests = lib.requests(prompts, max(len(prompts), 2 * args.level))
    speeds: dict[str, list[float]] = {m: [] for m in methods}
    steps: dict[str, list[list[tuple[int, float, float]]]] = {m: [] for m in methods}
    log = StepLog()
    if args.modeled:
        log.install()
    for _ in range(args.rounds):
        for m in methods:  # interleaved: each round's ratios share the machine's state of that moment
            fresh = args.fresh
            if args.stored_prompts:
                lib.store_prompts(m, args.level, requests, fresh=fresh)
                fresh = False
                log.take()  # (untimed)
            speeds[m].append(lib.tokens_per_s(m, args.level, requests, args.max_tokens, fresh=fresh)[0])
            steps[m].append(log.take())
    seconds = modeled(steps) if args.modeled else {}
    rows = []
    print(f"{cpu_model()}, {args.model}, {args.threads} thread(s), {args.level} at a time, {len(requests)} requests"
          f"{', a fresh engine each' if args.fresh else ''}{', prompts stored first' if args.stored_prompts else ''}")
    print(f"{'method':24s} {'tok/s':>7s} {'vs none':>8s}" + (f" {'modeled':>8s} {'plan s':>7s}" if seconds else "")
          + "  rounds")
    for m in methods:
        ratios = [a / b for a, b in zip(speeds[m], speeds["none"])]
        rows.append({"method": m, "tokens_per_s": statistics.median(speeds[m]), "vs_none": statistics.median(ratios),
                     "rounds": ratios})
        if seconds:  # (every method's runs emit the same tokens: the ratio of seconds is that of speeds)
            rows[-1]["modeled_vs_none"] = statistics.median(n / s for n, s in zip(seconds["none"], seconds[m]))
            rows[-1]["plan_s"] = statistics.median(sum(plan for *_, plan in run) for run in steps[m])
        print(f"{m:24s} {rows[-1]['tokens_per_s']:7.1f} {rows[-1]['vs_none']:8.3f}"
              + (f" {rows[-1]['modeled_vs_none']:8.3f} {rows[-1]['plan_s']:7.3f}" if seconds else "")
              + f"  {[round(r, 2) for r in ratios]}")
    print(json.dumps({"cpu": cpu_model(), "model": args.model, "threads": args.threads, "level": args.level,
                      "requests": len(requests), "fresh": args.fresh, "stored_prompts": args.stored_prompts,
                      "rows": rows}))


if __name__ == "__main__":
    main()
