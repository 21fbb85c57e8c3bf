"""What libgomp's spin count does to plain decoding, alone and beside a neighbour that also spins: another process
running torch matrix products on as many threads, at libgomp's default spin (what a second server, a test
runner or a notebook on the same cores looks like).

Each (spin count, condition) runs in a fresh process (libgomp reads ``GOMP_SPINCOUNT`` once, when torch loads it),
interleaved per round. Threads are arranged as ``serve`` arranges them: the model loads on a passing thread and
decodes on a thread of its own while the main thread waits. It prints a table (median tokens/s, and the median of
per-round ratios to libgomp's own default alone) and one JSON line. It does not start a server
(``cores.bound_openmp_spin`` is what the command line sets).

    python benchmarks/openmp_spin.py --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

DEFAULT = "libgomp"  # GOMP_SPINCOUNT unset: libgomp's own default

_CHILD = """
import sys, threading, time, torch
from specdecode.engine import Engine
from specdecode.serve.kernel_team import on_passing_thread, use_kernel_threads
from specdecode.target import TargetConfig

model, threads, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)  # as serve arranges its threads: the main thread idle, one team on the decoding thread
loaded = on_passing_thread(lambda: TargetConfig(model).load(), threads)
engine = Engine(loaded.model, loaded.tokenizer)
speed = []

def decode():
    use_kernel_threads(threads)
    engine.generate("Write a story about a dragon and a knight.", max_new_tokens=8)
    start = time.perf_counter()
    result = engine.generate("Write a story about a dragon and a knight.", max_new_tokens=tokens, eos_token_ids=())
    speed.append(len(result.token_ids) / (time.perf_counter() - start))

thread = threading.Thread(target=decode)
thread.start()
thread.join()
print(speed[0])
"""

_NEIGHBOUR = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
a, b = torch.randn(256, 256), torch.randn(256, 256)
while True:
    (a @ b).sum()
"""


def _decode(model: str, threads: int, tokens: int, spin: str, beside: bool) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    if spin != DEFAULT:
        env["GOMP_SPINCOUNT"] = spin
    neighbour = None
    if beside:  # at libgomp's default spin, as torch runs anywhere else
        neighbour = subprocess.Popen([sys.executable, "-c", _NEIGHBOUR, str(threads)], env={
            k: v for k, v in env.items() if k != "GOMP_SPINCOUNT"})
        time.sleep(1.0)
    try:
        run = subprocess.run([sys.executable, "-c", _CHILD, model, str(threads), str(tokens)], env=env,
                             capture_output=True, text=True, check=True)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    return float(run.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--spins", default="10000,3000", help="comma-separated GOMP_SPINCOUNT values besides libgomp's own")
    args = p.parse_args()
    from specdecode.models.native import cpu_model

    spins = [DEFAULT, *args.spins.split(",")]
    cases = [(spin, beside) for spin in spins for beside in (False, True)]
    speeds: dict[tuple[str, bool], list[float]] = {case: [] for case in cases}
    for _ in range(args.rounds):
        for spin, beside in cases:
            speeds[spin, beside].append(_decode(args.model, args.threads, args.max_tokens, spin, beside))
    print(f"{cpu_model()}, {args.model}, {args.threads} kernel threads, {args.max_tokens} tokens; "
          f"neighbour: torch matmuls on {args.threads} threads at libgomp's default spin")
    print(f"{'GOMP_SPINCOUNT':>14s} {'alone':>7s} {'beside':>7s} {'alone/default':>14s} {'beside/default':>15s}")
    rows = []
    for spin in spins:
        ratio = {beside: statistics.median(a / b for a, b in zip(speeds[spin, beside], speeds[DEFAULT, False]))
                 for beside in (False, True)}
        rows.append({"spin": spin, "alone_tokens_per_s": statistics.median(speeds[spin, False]),
                     "beside_tokens_per_s": statistics.median(speeds[spin, True]),
                     "alone_vs_default_alone": ratio[False], "beside_vs_default_alone": ratio[True]})
        print(f"{spin:>14s} {rows[-1]['alone_tokens_per_s']:7.1f} {rows[-1]['beside_tokens_per_s']:7.1f} "
              f"{ratio[False]:14.3f} {ratio[True]:15.3f}")
    print(json.dumps({"cpu": cpu_model(), "model": args.model, "threads": args.threads, "tokens": args.max_tokens,
                      "rows": rows}))


if __name__ == "__main__":
    main()
