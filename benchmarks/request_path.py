"""Where a served request's time goes: ``specdecode serve --drafter none`` answers the bench's chat prompts one at
a time, streamed and then whole (non-streamed), while py-spy samples its Python threads and /proc counts every
thread's CPU time. Then the library (``BatchEngine.run``, no HTTP) runs the same requests in this process.

It prints, per request, the CPU milliseconds of each stage of the HTTP side (parsing, chat template and
tokenization, response bodies, the HTTP protocol, the event loop) and of the engine thread (the forward,
the rest of its Python), each also as a fraction of one decode step, the server's tokens/s against the
library's, and one JSON line. py-spy reads the server's memory from outside, so sampling slows it little.

It does not change the server or look inside the kernels (they are one frame: the forward).

    python benchmarks/request_path.py --requests 14 --max-tokens 96 --threads 2
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from specdecode.bench.child_server import Server
from specdecode.bench.library import Library
from specdecode.bench.load import stream_chat
from specdecode.bench.prompts import default_prompts, select
from specdecode.bench.serve_command import chat_bodies
from specdecode.models.native import cpu_model
from specdecode.target import TargetConfig

# A sample's stage: the first of these whose marker is in one of its frames, looked for in this order.
HTTP_STAGES = (
    ("chat template and tokenization", ("encode_chat", "encode_prompt", "apply_chat_template")),
    ("response bodies (JSON, SSE)", ("sse (", "Reply.", "JSONResponse", "render (", "dumps (")),
    ("request parsing and validation", ("solve_dependencies", "_validate", "Request.json", "Request.body",
                                        "validate_python", "request_body_to_args", "loads (")),
    ("HTTP protocol (uvicorn)", ("uvicorn/protocols", "h11", "httptools")),
    ("event loop (asyncio)", ("asyncio/", "selectors.py")),
)
ENGINE_STAGES = (
    ("forward (kernels)", ("forward", "layers_rows", "project_rows")),
    ("outputs to the HTTP side", ("on_output", "call_soon_threadsafe", "stream.py", "decode (")),
)
ENGINE_THREAD = "specdecode-engine"


def whole_chat(host: str, port: int, body: dict, timeout: float = 600.0) -> tuple[float, int]:
    """One non-streamed chat completion: (seconds, completion tokens)."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {data[:200]!r}")
        return time.perf_counter() - start, json.loads(data)["usage"]["completion_tokens"]
    finally:
        conn.close()


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid``, from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def stage_of(frames: str, stages: tuple) -> str:
    for name, markers in stages:
        if any(m in frames for m in markers):
            return name
    return "other Python"


def read_samples(raw: Path) -> tuple[dict[str, Counter], dict[str, Counter], dict[str, int]]:
    """py-spy's raw lines ("thread (TID): NAME;frame;... COUNT") -> samples per stage of each thread kind, samples
    per (stage, innermost frame), and the thread id of each named thread."""
    stages: dict[str, Counter] = {"http": Counter(), "engine": Counter()}
    leaves: dict[str, Counter] = {"http": Counter(), "engine": Counter()}
    tids: dict[str, int] = {}
    for line in raw.read_text().splitlines():
        head, _, count = line.rpartition(" ")
        thread, _, frames = head.partition(";")
        tid, name = int(thread.split("(")[1].split(")")[0]), thread.split(": ", 1)[1]
        tids[name] = tid
        kind, table = ("engine", ENGINE_STAGES) if name == ENGINE_THREAD else ("http", HTTP_STAGES)
        if name in (ENGINE_THREAD, "MainThread"):
            stage = stage_of(frames, table)
            stages[kind][stage] += int(count)
            leaves[kind][f"{stage}: {frames.rsplit(';', 1)[-1]}"] += int(count)
    return stages, leaves, tids


def send_all(server: Server, bodies: list[dict], stream: bool) -> tuple[float, int, list[float]]:
    """Sends ``bodies`` one at a time: wall seconds, completion tokens, gaps between streamed chunks."""
    start, tokens, gaps = time.perf_counter(), 0, []
    for i, body in enumerate(bodies):
        if stream:
            result = stream_chat("127.0.0.1", server.port, body, i)
            if result.error:
                raise RuntimeError(result.error)
            tokens += result.tokens
            gaps += result.gaps_s
        else:
            tokens += whole_chat("127.0.0.1", server.port, body)[1]
    return time.perf_counter() - start, tokens, gaps


def profile_mode(server: Server, bodies: list[dict], stream: bool, rate: int, workdir: Path) -> dict:
    """Sends ``bodies`` one at a time, first alone (tokens/s), then while py-spy samples the server (CPU per
    thread, samples per stage)."""
    pid = server.proc.pid
    wall, tokens, gaps = send_all(server, bodies, stream)
    raw = workdir / f"{'stream' if stream else 'whole'}.txt"
    spy = subprocess.Popen([shutil.which("py-spy") or "py-spy", "record", "--pid", str(pid), "--threads", "--format",
                            "raw", "--rate", str(rate), "--output", str(raw), "--nonblocking"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaches
    before = thread_cpu(pid)
    send_all(server, bodies, stream)
    after = thread_cpu(pid)
    spy.send_signal(2)  # SIGINT: py-spy writes what it sampled
    spy.wait(timeout=60)
    stages, leaves, tids = read_samples(raw)
    cpu = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    main, engine = cpu.get(pid, 0.0), cpu.get(tids.get(ENGINE_THREAD, -1), 0.0)
    return {"wall_s": wall, "tokens": tokens, "step_ms": 1e3 * statistics.median(gaps) if gaps else None,
            "cpu_s": {"http (main thread)": main, "engine thread": engine,
                      "kernel workers and others": sum(cpu.values()) - main - engine},
            "samples": {k: dict(v) for k, v in stages.items()},
            "top_frames": {k: dict(v.most_common(8)) for k, v in leaves.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=None, help="kernel threads (default: serve's own default)")
    p.add_argument("--requests", type=int, default=14)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    args = p.parse_args()
    if shutil.which("py-spy") is None and not Path(sys.executable).with_name("py-spy").exists():
        p.error("py-spy is not installed (pip install py-spy)")
    prompts = select(default_prompts(), limit=2)
    bodies = chat_bodies(prompts, args.max_tokens, args.requests)
    flags = ["--model", args.model, "--served-model-name", "m", "--drafter", "none",
             *(["--threads", str(args.threads)] if args.threads else [])]
    server = Server("specdecode", flags)
    modes = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            server.wait_ready()
            whole_chat("127.0.0.1", server.port, bodies[0])  # warm-up: the first request builds the kernels' team
            for stream in (True, False):
                modes["stream" if stream else "whole"] = profile_mode(server, bodies, stream, args.rate, Path(tmp))
        finally:
            server.stop()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    lib = Library(TargetConfig(args.model), lambda _line: None)
    requests = lib.requests(prompts, args.requests)
    lib.tokens_per_s("none", 1, requests[:1], 8)  # warm-up
    library_tps = statistics.median(lib.tokens_per_s("none", 1, requests, args.max_tokens)[0] for _ in range(2))
    step_ms = modes["stream"]["step_ms"]
    print(f"{cpu_model()}, {args.model}, {args.requests} requests of <= {args.max_tokens} tokens, one at a time; "
          f"decode step {step_ms:.2f} ms (median gap between streamed chunks)")
    print(f"library (BatchEngine.run, no HTTP): {library_tps:.1f} tok/s")
    for mode, m in modes.items():
        per = 1e3 / args.requests
        tps = m["tokens"] / m["wall_s"]
        print(f"\n{mode}: {tps:.1f} tok/s = {tps / library_tps:.3f}x the library; CPU ms per request: " +
              ", ".join(f"{k} {v * per:.1f}" for k, v in m["cpu_s"].items()))
        for kind, thread in (("http", "http (main thread)"), ("engine", "engine thread")):
            total = sum(m["samples"][kind].values()) or 1
            for stage, n in sorted(m["samples"][kind].items(), key=lambda kv: -kv[1]):
                ms = m["cpu_s"][thread] * per * n / total
                print(f"  {kind:6s} {stage:34s} {ms:7.2f} ms/request  {ms / step_ms:6.2f} steps  "
                      f"{ms / (m['tokens'] / args.requests) * 1e3:7.1f} us/token")
    print(json.dumps({"cpu": cpu_model(), "model": args.model, "requests": args.requests, "max_tokens": args.max_tokens,
                      "step_ms": step_ms, "library_tokens_per_s": library_tps, "modes": modes}))


if __name__ == "__main__":
    main()
