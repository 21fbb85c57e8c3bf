"""What Ray Serve's machinery costs per streamed chunk: the CPU time of its HTTP proxy and our ingress.

Starts ``specdecode serve --ray --replicas 1`` (a local cluster), sends the packaged chat prompts from
``--concurrency`` closed-loop clients, and reads the CPU seconds (user + system, from /proc) that the
proxy actor, the ingress replica, the engine replica and the rest of Ray's processes used during the run;
divides by the content chunks relayed. The proxy's and ingress's share bounds how many chunks per second
one head node can relay: the input of the N-machine throughput model in docs/benchmarks/history.md ("Scale-out on Ray Serve").

Prints a table and one JSON line. It does not measure latency (``specdecode bench-serve`` does).

    python benchmarks/ray_overhead.py --concurrency 4 --requests 16 --max-tokens 96
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from specdecode.bench.load import run_level, summarize
from specdecode.bench.prompts import default_prompts, select
from specdecode.bench.serve_command import Server
from specdecode.serve.ray_app import APP_NAME

ROLES = {"proxy": "ProxyActor", "ingress": f"ServeReplica:{APP_NAME}:Ingress",
         "engine": f"ServeReplica:{APP_NAME}:EngineServer"}


def _cpu_seconds() -> dict[int, tuple[str, float]]:
    """pid -> (command line, user + system CPU seconds) of every process."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(pid)] = (cmd, (int(fields[11]) + int(fields[12])) / ticks)
        except (OSError, IndexError, ValueError):
            continue
    return out


def _by_role(before: dict, after: dict, server_pid: int) -> dict[str, float]:
    used = {role: 0.0 for role in (*ROLES, "other ray", "cli")}
    for pid, (cmd, cpu) in after.items():
        delta = cpu - before.get(pid, (cmd, 0.0))[1]
        role = next((r for r, marker in ROLES.items() if marker in cmd), None)
        if role is None and pid == server_pid:
            role = "cli"
        elif role is None and ("ray" in cmd and ("gcs_server" in cmd or "raylet" in cmd or "ray::" in cmd
                                                 or "ray/_private" in cmd or "dashboard" in cmd)):
            role = "other ray"
        if role is not None:
            used[role] += delta
    return used


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=16, help="requests, cycling through the packaged prompts")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--cpus-per-replica", default=str(os.cpu_count()))
    args = p.parse_args()

    server = Server("ray1", ["--model", args.model, "--served-model-name", "m", "--drafter", "none", "--ray",
                             "--replicas", "1", "--cpus-per-replica", args.cpus_per_replica, "--max-running",
                             str(args.concurrency), "--log-level", "warning"])
    try:
        server.wait_ready()
        prompts = select(default_prompts(), limit=2)
        bodies = [{"model": "m", "messages": list(q.messages) if q.messages is not None else
                   [{"role": "user", "content": q.prompt}], "max_tokens": args.max_tokens, "temperature": 0}
                  for q in (prompts[i % len(prompts)] for i in range(args.requests))]
        run_level("127.0.0.1", server.port, bodies[:args.concurrency], args.concurrency)  # warm
        before = _cpu_seconds()
        results, wall = run_level("127.0.0.1", server.port, bodies, args.concurrency)
        after = _cpu_seconds()
    finally:
        server.stop()
    summary = summarize(results, wall)
    chunks = sum(len(r.gaps_s) + 1 for r in results if r.error is None)
    if chunks == 0:
        print(f"no request succeeded: {[r.error for r in results][:3]}", file=sys.stderr)
        return 1
    used = _by_role(before, after, server.proc.pid)
    print(f"{summary['tokens']} tokens in {chunks} chunks over {wall:.1f} s ({summary['tokens_per_s']:.1f} tok/s), "
          f"{summary['errors']} errors")
    print(f"{'process':<12}{'CPU s':>8}{'ms/chunk':>10}{'share':>8}")
    total = sum(used.values())
    for role, cpu in used.items():
        print(f"{role:<12}{cpu:>8.2f}{1e3 * cpu / chunks:>10.3f}{cpu / total:>8.1%}")
    relay_ms = 1e3 * (used["proxy"] + used["ingress"]) / chunks
    print(json.dumps({"bench": "ray_overhead", "model": args.model, "concurrency": args.concurrency,
                      "tokens": summary["tokens"], "chunks": chunks, "wall_s": round(wall, 3),
                      "tokens_per_s": round(summary["tokens_per_s"], 2), "cpu_s": {k: round(v, 3) for k, v in used.items()},
                      "relay_ms_per_chunk": round(relay_ms, 4), "relay_chunks_per_core_s": round(1e3 / relay_ms, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
