"""Start-up cost of `specdecode generate --max-new-tokens 1 Hello`: wall seconds and peak RSS of the whole
process (interpreter and imports included), cold (no packed model, no remembered cost curve) and warm.

    python benchmarks/start_time.py --models qwen2.5-coder-1.5b-instruct,smollm2-135m-instruct --warm 3
    python benchmarks/start_time.py --pythonpath /tmp/old/src --no-cold   # another checkout's code, same cache

Prints a table and one JSON line. It deletes `packed/` and `costs/` under the cache (``$SPECDECODE_CACHE`` or
~/.cache/specdecode) before each cold start; fetched models and tokenizers stay.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from specdecode.models.fetch import cache_dir


def run_once(model: str, pythonpath: str | None) -> tuple[float, float]:
    """(wall seconds, peak RSS in MB) of one start."""
    env = dict(os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {}))
    cmd = [sys.executable, "-m", "specdecode.cli", "generate", "--model", model, "--max-new-tokens", "1", "Hello"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.read()}")
    return wall, usage.ru_maxrss / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen2.5-coder-1.5b-instruct,smollm2-135m-instruct")
    p.add_argument("--warm", type=int, default=3, help="warm starts per model (median reported)")
    p.add_argument("--no-cold", action="store_true", help="keep the caches; warm starts only")
    p.add_argument("--pythonpath", default=None, help="run another checkout's src/ (its caches are shared)")
    args = p.parse_args()
    rows = []
    for model in args.models.split(","):
        row: dict[str, object] = {"model": model}
        if not args.no_cold:
            for sub in ("packed", "costs"):
                shutil.rmtree(cache_dir() / sub, ignore_errors=True)
            row["cold_s"], row["cold_mb"] = run_once(model, args.pythonpath)
        warm = [run_once(model, args.pythonpath) for _ in range(args.warm)]
        row["warm_s"] = statistics.median(w for w, _ in warm)
        row["warm_mb"] = max(m for _, m in warm)
        rows.append(row)
    print(f"{'model':32} {'cold s':>8} {'cold MB':>8} {'warm s':>8} {'warm MB':>8}")
    for r in rows:
        cold = f"{r['cold_s']:8.2f} {r['cold_mb']:8.0f}" if "cold_s" in r else f"{'-':>8} {'-':>8}"
        print(f"{r['model']:32} {cold} {r['warm_s']:8.2f} {r['warm_mb']:8.0f}")
    print(json.dumps({"start_time": rows}))


if __name__ == "__main__":
    main()
