"""What a second OpenMP team costs: plain decoding in ``BatchEngine.run`` on the main thread, on a second thread
(the only one that runs torch), and on a second thread after the main thread ran one parallel torch op (its own
team: what a server had when it loaded the model on the serving thread and stepped on the engine loop's).

Each mode runs in a fresh process (a team, once made, lives as long as its thread), the modes interleaved per
round. It prints a table (median tokens/s, the median of per-round ratios to ``main``) and one JSON line. It
does not start a server (``specdecode bench-serve`` measures ``serve``; ``serve/kernel_team.py`` is the fix).

    python benchmarks/openmp_teams.py --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

MODES = ("main", "second-thread", "two-teams")

_CHILD = """
import sys, threading, time, torch
from specdecode.batch.executor import BatchEngine
from specdecode.batch.scheduler import SchedulerConfig
from specdecode.target import TargetConfig

mode, model, threads, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
speed = []

def decode():
    loaded = TargetConfig(model).load()
    engine = BatchEngine(loaded.model, loaded.tokenizer, None, scheduler=SchedulerConfig(max_running=1))
    engine.warmup()
    requests = [dict(prompt="Write a story about a dragon and a knight.", max_new_tokens=tokens)] * 4
    engine.run(requests[:1])
    start = time.perf_counter()
    results = engine.run(requests)
    speed.append(sum(len(r.token_ids) for r in results) / (time.perf_counter() - start))

if mode == "main":
    decode()
else:
    if mode == "two-teams":
        (torch.ones(1 << 22) * 2).sum()  # the main thread's own team
    thread = threading.Thread(target=decode)
    thread.start()
    thread.join()
print(speed[0])
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args()
    from specdecode.models.native import cpu_model

    speeds: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            run = subprocess.run([sys.executable, "-c", _CHILD, mode, args.model, str(args.threads),
                                  str(args.max_tokens)], capture_output=True, text=True, check=True)
            speeds[mode].append(float(run.stdout.strip().splitlines()[-1]))
    print(f"{cpu_model()}, {args.model}, {args.threads} kernel threads, 4 requests of {args.max_tokens} tokens")
    print(f"{'mode':14s} {'tok/s':>7s} {'vs main':>8s}  rounds")
    rows = []
    for mode in MODES:
        ratios = [a / b for a, b in zip(speeds[mode], speeds["main"])]
        rows.append({"mode": mode, "tokens_per_s": statistics.median(speeds[mode]),
                     "vs_main": statistics.median(ratios), "rounds": ratios})
        print(f"{mode:14s} {rows[-1]['tokens_per_s']:7.1f} {rows[-1]['vs_main']:8.3f}  {[round(r, 2) for r in ratios]}")
    print(json.dumps({"cpu": cpu_model(), "model": args.model, "threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
