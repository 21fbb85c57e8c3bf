"""Where a batch's steps go, per method: planning (the controllers and drafters), the forward, acceptance
(verification and rollback) and settling (commits, records, outputs), in the library's ``BatchEngine.run`` of the
bench's chat prompts at most ``--level`` at a time, every method in turn per round (a fresh engine each, its prompts
first stored in its prefix cache, as in bench-serve's servers).

It prints per method the median over rounds of each part's seconds a run, its steps and forward rows, and the
steps' tokens/s against plain decoding's in the same round; then one JSON line. With ``--argmax`` each method also
runs with the greedy pick as torch's ``argmax`` (what ``sampling.argmax_ids`` replaced), named ``METHOD+argmax``:
an A/B of the pick in one process. The parts are timed by wrapping the engine's own phases (``Proposer.plan``,
``StepForward.run``, ``executor.accept``, ``BatchEngine._settle``), not by a copy of its step. It does not start a
server (``bench-serve`` does) or price steps by rows (``library_ngram_load.py --modeled`` does).

    python benchmarks/step_parts.py --level 8 --rounds 4 --methods none,auto:adaptive
    python benchmarks/step_parts.py --level 8 --rounds 6 --methods none --argmax
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from specdecode.cores import bound_openmp_spin

if __name__ == "__main__":  # as the command line does, before torch loads libgomp (which reads its spin count once)
    bound_openmp_spin()

import torch  # noqa: E402

from specdecode import verify  # noqa: E402
from specdecode.batch import executor  # noqa: E402
from specdecode.batch.executor import BatchEngine  # noqa: E402
from specdecode.batch.forward import StepForward  # noqa: E402
from specdecode.batch.proposing import Proposer  # noqa: E402
from specdecode.bench.library import Library  # noqa: E402
from specdecode.bench.prompts import default_prompts, select  # noqa: E402
from specdecode.models.native import cpu_model  # noqa: E402
from specdecode.target import TargetConfig  # noqa: E402

PARTS = ("plan", "forward", "accept", "settle")
ARGMAX = "+argmax"  # a method's name with torch's argmax as the greedy pick


class PartTimer:
    """Seconds spent in each of a step's parts while installed, and the steps' count and forward rows."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.steps = self.rows = 0

    def _timed(self, part: str, call: Callable) -> Callable:
        def timed(*args, **kwargs):
            tick = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - tick
        return timed

    @contextmanager
    def installed(self) -> Iterator[None]:
        plan, run, accept, settle = Proposer.plan, StepForward.run, executor.accept, BatchEngine._settle

        def counted_plan(proposer, running):
            made = plan(proposer, running)
            self.steps += 1
            self.rows += made.rows
            return made
        Proposer.plan = self._timed("plan", counted_plan)
        StepForward.run = self._timed("forward", run)
        executor.accept = self._timed("accept", accept)
        BatchEngine._settle = self._timed("settle", settle)
        try:
            yield
        finally:
            Proposer.plan, StepForward.run, executor.accept, BatchEngine._settle = plan, run, accept, settle

    def take(self) -> dict[str, float]:
        out = {**self.seconds, "steps": self.steps, "rows": self.rows}
        self._reset()
        return out


@contextmanager
def greedy_pick(use_argmax: bool) -> Iterator[None]:
    """Verification's greedy pick as shipped, or (``use_argmax``) torch's argmax."""
    shipped = verify.argmax_ids
    if use_argmax:
        verify.argmax_ids = lambda logits: logits.argmax(-1)
    try:
        yield
    finally:
        verify.argmax_ids = shipped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--level", type=int, default=8, help="requests running at once")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--limit", type=int, default=10, help="prompts per category of the chat suites")
    p.add_argument("--methods", default="none,auto:adaptive", help="comma-separated, plain (none) first")
    p.add_argument("--argmax", action="store_true", help="each method also with torch's argmax as the greedy pick")
    args = p.parse_args()
    methods = args.methods.split(",")
    if methods[0] != "none":
        p.error("--methods must start with none (the ratios' reference)")
    runs = [name for m in methods for name in ([m, m + ARGMAX] if args.argmax else [m])]
    torch.set_num_threads(args.threads)
    lib = Library(TargetConfig(args.model), lambda _line: None)
    prompts = select(default_prompts(), limit=args.limit)
    requests = lib.requests(prompts, max(len(prompts), 2 * args.level))
    timer, results = PartTimer(), {name: [] for name in runs}
    for r in range(args.rounds):
        for name in (runs if r % 2 == 0 else runs[::-1]):  # each order half the rounds: drift within a round cancels
            method = name.removesuffix(ARGMAX)
            lib.store_prompts(method, args.level, requests, fresh=True)
            with greedy_pick(name.endswith(ARGMAX)), timer.installed():
                tokens_per_s = lib.tokens_per_s(method, args.level, requests, args.max_tokens)[0]
            results[name].append({"tokens_per_s": tokens_per_s, **timer.take()})
    rows = []
    print(f"{cpu_model()}, {args.model}, {args.threads} thread(s), {args.level} at a time, {len(requests)} requests, "
          f"{args.rounds} rounds (medians; vs none: the median of each round's ratio)")
    print(f"{'method':26s} {'tok/s':>7s} {'vs none':>8s} {'steps':>6s} {'rows':>6s}"
          + "".join(f" {part + ' s':>9s}" for part in PARTS))
    for name in runs:
        own, plain = results[name], results["none"]
        row = {"method": name, **{key: statistics.median(run[key] for run in own) for key in own[0]},
               "vs_none": statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(own, plain)),
               "rounds_vs_none": [round(a["tokens_per_s"] / b["tokens_per_s"], 3) for a, b in zip(own, plain)]}
        rows.append(row)
        print(f"{name:26s} {row['tokens_per_s']:7.1f} {row['vs_none']:8.3f} {row['steps']:6.0f} {row['rows']:6.0f}"
              + "".join(f" {row[part]:9.3f}" for part in PARTS))
    print(json.dumps({"cpu": cpu_model(), "model": args.model, "threads": args.threads, "level": args.level,
                      "requests": len(requests), "rounds": args.rounds, "rows": rows}))


if __name__ == "__main__":
    main()
