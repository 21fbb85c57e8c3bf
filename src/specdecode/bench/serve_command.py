"""``specdecode bench-serve``: the real server under load, plain decoding vs speculation, side by side.

One ``specdecode serve`` process per method (``none`` = plain decoding, ``ngram:<gamma>``, ``eagle:<gamma>``,
``medusa:<gamma>`` with the heads shipped for the model), and with ``llamacpp`` llama-cpp-python's
OpenAI-compatible server on the same GGUF as a peer (it serves one request at a time); ``rayN:METHOD``
serves METHOD through Ray Serve by N replicas sharing the cores (``serve --ray``). All are started
before the first measurement and measured in turns: for each concurrency level and repeat, every method
in order (reversed every other repeat), so that drift on a noisy machine touches them alike. Each run sends
the same greedy chat requests (the packaged suites, or ``--prompts``) from ``concurrency`` closed-loop clients
on loopback.
Reported per method and level (medians over repeats): aggregate tokens/s, TTFT and inter-chunk latency
p50/p99, and every ratio to plain decoding and to the library (the same requests through ``BatchEngine.run``
in this process, ``library.py``); the ratio to plain decoding also as the median of each repeat's own ratio
(paired rounds); plus whether every answer equals plain decoding's. Prints a table and one
JSON line; ``--out`` writes the JSON, a Markdown report and plots.

It does not define the load (``load.py``) or the server (``serve/``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from specdecode.argtypes import positive_int
from specdecode.bench.agents import AGENT_WORKLOAD, agent_table, print_agent_table, run_sessions, summarize_sessions
from specdecode.bench.child_server import Server
from specdecode.bench.library import Library
from specdecode.bench.load import run_level, summarize
from specdecode.bench.prompts import default_prompts, packaged_prompts, select
from specdecode.bench import llamacpp_tools
from specdecode.cores import server_threads, usable_cores
from specdecode.bench.llamacpp_server import ServerOptions
from specdecode.drafter_setup import PLAIN
from specdecode.drafters import registry
from specdecode.flags import add_model_arguments
from specdecode.models.native import cpu_flags, cpu_model
from specdecode.prompts import load_prompts
from specdecode.target import TargetConfig

# Drafters a server runs on the target alone (the heads: the shipped ones).
SERVED_DRAFTERS = registry.names_where(lambda spec: spec.self_contained)
# llama-cpp-python's server (`pip install 'llama-cpp-python[server]'`, one request at a time) and llama.cpp's own
# llama-server with --max-running slots (`specdecode peers build`): a GGUF model only.
PEERS = ("llamacpp", "llamacpp-server")
PEER_READY = {"llamacpp": "/v1/models", "llamacpp-server": "/health"}
METRICS = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")


def _levels(value: str) -> list[int]:
    try:
        levels = [int(x) for x in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {value!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be >= 1, got {value!r}")
    return levels


def _on_ray(method: str) -> tuple[int, str]:
    """``rayN:METHOD`` -> (N, METHOD): METHOD served through Ray Serve by N replicas; (0, method) otherwise."""
    head, _, rest = method.partition(":")
    if head.startswith("ray") and head[3:].isdigit() and int(head[3:]) >= 1 and rest:
        return int(head[3:]), rest
    return 0, method


def _peer(method: str) -> tuple[str, int | None] | None:
    """``PEER`` or ``PEER:tN`` (the peer on N threads) -> (PEER, N or None); None for our methods."""
    name, colon, threads = method.partition(":")
    if name not in PEERS:
        return None
    if not colon:
        return name, None
    if threads[:1] == "t" and threads[1:].isdigit() and int(threads[1:]) >= 1:
        return name, int(threads[1:])
    raise argparse.ArgumentTypeError(f"method {method!r}: a peer takes its thread count as {name}:tN (e.g. {name}:t1)")


def _methods(value: str) -> list[str]:
    methods = [m.strip() for m in value.split(",") if m.strip()]
    for m in methods:
        if _peer(m):
            continue
        drafter, _, gamma = _on_ray(m)[1].partition(":")
        if drafter not in (PLAIN, *SERVED_DRAFTERS) or bool(gamma) != (drafter != PLAIN):
            raise argparse.ArgumentTypeError(f"method {m!r}: expected {PLAIN!r}, DRAFTER:GAMMA with DRAFTER one of "
                                             f"{', '.join(SERVED_DRAFTERS)} (e.g. ngram:adaptive, eagle:4), either "
                                             f"prefixed by rayN: for N replicas on Ray Serve, or a peer: "
                                             f"{', '.join(PEERS)}, each optionally :tN for N threads")
    if PLAIN not in methods:
        methods.insert(0, PLAIN)  # the reference every ratio is taken against
    return methods


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every ``bench-serve`` flag, the shared model flags first (no ``--device``: the servers choose theirs)."""
    add_model_arguments(p, device=False,
                        threads_default="each server's own default (specdecode serve: every core, but one from 8 up)")
    p.add_argument("--methods", type=_methods, default=_methods("none,ngram:adaptive"),
                   help="comma list: none (plain decoding, always run), DRAFTER:GAMMA for DRAFTER in "
                        f"{', '.join(SERVED_DRAFTERS)}, either prefixed by rayN: (served by N replicas on Ray Serve, "
                        "sharing the cores), and the peers llamacpp (llama-cpp-python's server on the same GGUF) "
                        "and llamacpp-server (llama.cpp's own, --max-running slots; `specdecode peers build`), "
                        "each on --threads threads or, as PEER:tN, on N (default none,ngram:adaptive)")
    p.add_argument("--concurrency", type=_levels, default=_levels("1,2,4,8"),
                   help="concurrent clients per level (default 1,2,4,8)")
    p.add_argument("--requests", type=positive_int, default=None,
                   help="requests per level (default: one per prompt, at least 2 per client)")
    p.add_argument("--max-tokens", type=positive_int, default=96, help="completion budget of each request (default 96)")
    p.add_argument("--repeats", type=positive_int, default=1, help="runs per method and level (median)")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl", help="your own prompts (default: packaged suites)")
    p.add_argument("--limit", type=positive_int, default=2, help="prompts per category of the suites (default 2)")
    p.add_argument("--workload", default=None, metavar="FILE.jsonl|SUITE",
                   help="replay a prompt file's requests (or a packaged suite's, e.g. agentic or edit) once each, in "
                        "file order, instead of --prompts/--limit; a server whose "
                        "drafter learns across requests (suffix) is restarted before each timed run, so that it "
                        "learns only from the run's earlier requests; `agent`: multi-turn sessions that call tools "
                        "(a calculator, a file reader, a search) and read their results (bench/agents.py)")
    p.add_argument("--max-running", type=positive_int, default=None,
                   help="the servers' --max-running (default: the highest concurrency level)")
    p.add_argument("--max-rows", type=positive_int, default=None, help="the servers' --max-rows (default: theirs)")
    p.add_argument("--prefill-chunk", type=positive_int, default=None,
                   help="the servers' --prefill-chunk (default: theirs)")
    p.add_argument("--out", default=None, metavar="DIR", help="write bench-serve.json, report.md and plots there")
    p.add_argument("--no-library", dest="library", action="store_false",
                   help="skip the library's reference runs (the same requests through BatchEngine.run in this "
                        "process, no HTTP; default: run them, and report each server's tokens/s against them)")


@dataclass(frozen=True)
class BenchServeConfig:
    """One ``specdecode bench-serve`` run.

    Args:
        model: the target every server serves (registry name, .gguf path, HF folder or hub id).
        dtype: the servers' ``--dtype``.
        linear: the servers' ``--linear``.
        weights: the servers' ``--weights``.
        threads: the servers' kernel threads (shared out among a Ray method's replicas); None = each server's
            default (``specdecode serve``: every core, but one from 8 up; a Ray method's replicas share all cores).
        methods: ``none`` first, then ``DRAFTER:GAMMA``, ``rayN:...`` and peers (see :func:`_methods`).
        concurrency: concurrent clients of each level.
        requests: requests per level; None = one per prompt, at least 2 per client.
        max_tokens: completion budget of each request.
        repeats: runs per method and level (medians are reported).
        prompts: a JSONL prompt file; None = the packaged suites.
        limit: prompts per category.
        workload: a JSONL prompt file replayed once per run in file order (``prompts``, ``limit`` and ``requests``
            then do not apply); None = none.
        max_running: the servers' ``--max-running``; None = the highest concurrency level.
        max_rows: the servers' ``--max-rows``; None = theirs.
        prefill_chunk: the servers' ``--prefill-chunk``; None = theirs.
        out: write bench-serve.json, report.md and plots into this folder; None = print only.
        library: also run each of our non-Ray methods through the library in this process (``library.py``),
            after its server at each level and repeat, and report the server's tokens/s against it.
    """

    model: str
    dtype: str = "auto"
    linear: str = "auto"
    weights: str = "auto"
    threads: int | None = None
    methods: tuple[str, ...] = (PLAIN, "ngram:adaptive")
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    requests: int | None = None
    max_tokens: int = 96
    repeats: int = 1
    prompts: str | None = None
    limit: int = 2
    max_running: int | None = None
    max_rows: int | None = None
    prefill_chunk: int | None = None
    out: str | None = None
    library: bool = True
    workload: str | None = None

    def __post_init__(self) -> None:
        if self.workload and (self.prompts or self.requests):
            raise ValueError("--workload replays its own requests; drop --prompts and --requests")
        if self.workload == AGENT_WORKLOAD and any(_peer(m) or _on_ray(m)[0] for m in self.methods):
            raise ValueError("--workload agent runs our own servers only (no peers, no Ray methods)")


def bench_serve_config(args: argparse.Namespace) -> BenchServeConfig:
    """The run :func:`add_arguments`' flags describe."""
    return BenchServeConfig(args.model, args.dtype, args.linear, args.weights, args.threads, tuple(args.methods),
                            tuple(args.concurrency), args.requests, args.max_tokens, args.repeats, args.prompts,
                            args.limit, args.max_running, args.max_rows, args.prefill_chunk, args.out,
                            args.library, args.workload)


def _server_flags(method: str, config: BenchServeConfig, max_running: int) -> list[str]:
    """The ``serve`` flags of one method's server; a ``rayN:`` method's replicas share this machine's cores
    (each reserves cores / N Ray CPUs, rounded down to Ray's 1e-4, and runs that many kernel threads, at
    least one)."""
    replicas, method = _on_ray(method)
    drafter, _, gamma = method.partition(":")
    flags = ["--model", config.model, "--served-model-name", "m", "--drafter", drafter, "--max-running", str(max_running),
             "--max-waiting", "1024", "--log-level", "warning", "--dtype", config.dtype, "--linear", config.linear,
             "--weights", config.weights]
    if gamma:
        flags += ["--gamma", gamma]
    if replicas:
        cores = config.threads or usable_cores()
        cpus = max(math.floor(cores / replicas * 1e4) / 1e4, 1e-4)  # N x cpus never exceeds the cores
        flags += ["--ray", "--replicas", str(replicas), "--cpus-per-replica", f"{cpus:.4f}".rstrip("0").rstrip(".")]
    elif config.threads:
        flags += ["--threads", str(config.threads)]
    for flag, value in (("--max-rows", config.max_rows), ("--prefill-chunk", config.prefill_chunk)):
        if value is not None:
            flags += [flag, str(value)]
    return flags


def _peer_command(method: str, config: BenchServeConfig, max_running: int) -> list[str]:
    """The command line of peer ``method`` on the GGUF ``--model`` names, with its thread count (``PEER:tN``, else
    the servers') and context (llama-server: ``max_running`` slots of it); refused with the reason where it cannot
    run."""
    import importlib.util

    from specdecode.models import registry
    from specdecode.models.fetch import fetch

    name, own_threads = _peer(method)

    if name == "llamacpp" and (importlib.util.find_spec("llama_cpp") is None
                               or importlib.util.find_spec("sse_starlette") is None):
        raise ValueError("--methods llamacpp needs llama-cpp-python's server: pip install 'llama-cpp-python[server]'")
    binary = llamacpp_tools.require("llama-server") if name == "llamacpp-server" else None  # names the build command
    try:
        path = str(fetch(registry.get(config.model)))
    except registry.UnknownModelError:
        path = config.model
    if not path.endswith(".gguf"):
        raise ValueError(f"--methods {name} needs a GGUF model; {config.model!r} is not one")
    threads = own_threads or config.threads or server_threads()  # by default as many as our server's
    if binary is not None:
        return ServerOptions(Path(path), threads, ctx=4096, slots=max_running).command(binary, "{port}")
    return [sys.executable, "-m", "llama_cpp.server", "--model", path, "--model_alias", "m", "--host", "127.0.0.1",
            "--port", "{port}", "--n_ctx", "4096", "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--interrupt_requests", "False"]  # its default cuts a running stream short when the next request comes


def chat_bodies(prompts: list, max_tokens: int, count: int) -> list[dict[str, Any]]:
    """``count`` greedy chat requests, cycling through ``prompts`` (with their predictions)."""
    bodies = []
    for i in range(count):
        p = prompts[i % len(prompts)]
        messages = list(p.messages) if p.messages is not None else [{"role": "user", "content": p.prompt}]
        body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        if p.prediction:
            body["prediction"] = {"type": "content", "content": p.prediction}
        bodies.append(body)
    return bodies


def _given(method: str, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The requests as ``method`` gets them: predictions go to our drafting methods only (plain decoding, the
    reference, and peers get none)."""
    if not _peer(method) and _on_ray(method)[1] != PLAIN:
        return requests
    return [{k: v for k, v in r.items() if k != "prediction"} for r in requests]


COLD, WARM = "cold", "warm"  # a learning drafter's passes: on a fresh server, then again over the same requests


def _learns(method: str) -> bool:
    """Whether ``method``'s drafter keeps what earlier requests generated (``DrafterSpec.learns``)."""
    drafter = _on_ray(method)[1].partition(":")[0]
    return not _peer(method) and drafter != PLAIN and registry.spec(drafter).learns


def _prompts(config: BenchServeConfig) -> list:
    """The prompts a run sends: its workload's (a file, or a packaged suite), else ``--prompts`` or the suites'."""
    if config.workload:
        path = Path(config.workload)
        return load_prompts(path) if path.exists() else packaged_prompts([config.workload])
    return select(load_prompts(config.prompts) if config.prompts else default_prompts(), limit=config.limit)


def run_command(config: BenchServeConfig, log: Callable[[str], None]) -> int:
    levels = sorted(set(config.concurrency))
    max_running = config.max_running or max(levels)
    if config.workload == AGENT_WORKLOAD:
        return _run_agents(config, levels, max_running, log)
    prompts = _prompts(config)
    peer_kinds = {m: _peer(m) for m in config.methods}
    peers = {m: _peer_command(m, config, max_running) for m in config.methods if peer_kinds[m]}  # before any starts
    servers: list[Server] = []
    library = None
    try:  # every server started is stopped whatever fails from here on
        for m in config.methods:
            servers.append(Server(m, [], peers[m], ready=PEER_READY[peer_kinds[m][0]]) if peer_kinds[m]
                           else Server(m, _server_flags(m, config, max_running)))
        if config.library:
            library = Library(TargetConfig(config.model, config.dtype, "auto", config.linear, config.weights), log)
        for s in servers:
            log(f"starting the {s.name} server on port {s.port} ...")
            s.wait_ready()
        runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
        texts: dict[tuple[str, int], list[list[str]]] = {}  # per repeat, each request's answer
        for level in levels:
            count = len(prompts) if config.workload else config.requests or max(len(prompts), 2 * level)
            bodies = chat_bodies(prompts, config.max_tokens, count)
            requests = library.requests(prompts, count) if library else []
            for s in servers:  # an untimed run, so that no level starts cold (one that learns starts afresh below)
                if not _learns(s.name):
                    run_level("127.0.0.1", s.port, _given(s.name, bodies)[:level], level)
                    _store_prompts(s, bodies, level)
            for r in range(config.repeats):
                # Every other repeat in reverse: a machine's drift over a repeat then favours no method.
                for i in range(len(servers)) if r % 2 == 0 else reversed(range(len(servers))):
                    s = servers[i]
                    passes = [s.name]
                    if _learns(s.name):  # afresh: it learns this run's requests, none of another's
                        s.stop()
                        s = servers[i] = Server(s.name, s.flags)
                        s.wait_ready()
                        _store_prompts(s, bodies, level)
                        passes = [s.name] if config.workload else [f"{s.name} {COLD}", f"{s.name} {WARM}"]
                    for row in passes:  # a learner's second pass sees the first's answers to the same requests
                        summary, answers = _timed_pass(s, row, level, bodies, requests, config, library, log)
                        runs.setdefault((row, level), []).append(summary)
                        texts.setdefault((row, level), []).append(answers)
    finally:
        for s in servers:
            try:
                s.stop()
            except Exception as exc:  # one that cannot stop cleanly does not keep the others running
                log(f"could not stop the {s.name} server: {exc}")
    report = _report(config, levels, runs, texts)
    _print_table(report, log)
    if config.out:
        _write(report, Path(config.out), log)
    print(json.dumps(report["summary"]))
    return 0


def _run_agents(config: BenchServeConfig, levels: list[int], max_running: int, log: Callable[[str], None]) -> int:
    """The agent workload (``agents.py``): each method's server, fresh for every timed run (a learning drafter, the
    prefix cache: each run starts cold), every session at each level; a table and one JSON line."""
    rows, transcripts = [], {}
    for level in levels:
        for r in range(config.repeats):
            for method in config.methods:
                server = Server(method, _server_flags(method, config, max_running))
                try:
                    log(f"starting the {method} server on port {server.port} ...")
                    server.wait_ready()
                    sessions, wall = run_sessions(server.port, level, config.max_tokens)
                finally:
                    server.stop()
                summary = summarize_sessions(sessions, wall)
                rows.append({"method": method, "concurrency": level, "repeat": r, **summary})
                transcripts.setdefault((method, level), []).append([s.transcript for s in sessions])
                log(f"c={level} {method}: {summary['tokens_per_s']:.1f} tok/s, {summary['turns']} turns, "
                    f"{summary['valid_calls']}/{summary['calls']} valid calls, errors {summary['errors']}")
    table = agent_table(rows, transcripts, levels, config.methods, PLAIN)
    print_agent_table(table, log)
    summary = {"bench": "serve", "workload": AGENT_WORKLOAD, "model": config.model, "max_tokens": config.max_tokens,
               "repeats": config.repeats, "cpu": cpu_model(),
               "rows": [{k: (round(v, 5) if isinstance(v, float) else v) for k, v in t.items()} for t in table]}
    if config.out:
        Path(config.out).mkdir(parents=True, exist_ok=True)
        (Path(config.out) / "bench-serve.json").write_text(json.dumps({"summary": summary, "runs": rows}, indent=1))
    print(json.dumps(summary))
    return 0


def _timed_pass(server: Server, row: str, level: int, bodies: list[dict[str, Any]], requests: list[dict[str, Any]],
                config: BenchServeConfig, library: Library | None,
                log: Callable[[str], None]) -> tuple[dict[str, Any], list[str]]:
    """One timed run of ``bodies`` at ``level`` through ``server`` (and the library's, where it runs the method),
    reported as ``row``: its summary and each request's answer."""
    results, wall = run_level("127.0.0.1", server.port, _given(server.name, bodies), level)
    summary = summarize(results, wall)
    if library is not None and _in_library(server.name):
        given = _given(server.name, requests)
        library.store_prompts(server.name, level, given, fresh=_learns(server.name) and not row.endswith(WARM))
        summary["library_tokens_per_s"], _ = library.tokens_per_s(server.name, level, given, config.max_tokens)
    log(f"c={level} {row}: {summary['tokens_per_s']:.1f} tok/s"
        + (f" (library {summary['library_tokens_per_s']:.1f})" if "library_tokens_per_s" in summary else "")
        + f", ITL p99 {1e3 * (summary['itl_p99_s'] or 0):.0f} ms, errors {summary['errors']}")
    return summary, [x.text for x in results]


def _store_prompts(server: Server, bodies: list[dict[str, Any]], level: int) -> None:
    """Sends every request once for one token, untimed: every server then holds the requests' prompts in its prefix
    cache alike (a restarted learner too, which learns nothing from one token)."""
    run_level("127.0.0.1", server.port, [dict(b, max_tokens=1) for b in _given(server.name, bodies)], level)


def _in_library(method: str) -> bool:
    """Whether the library runs ``method`` too (ours, in this process: not a peer, not on Ray)."""
    return not _peer(method) and not _on_ray(method)[0]


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _paired(runs: list[dict[str, Any]], plain: list[dict[str, Any]]) -> float | None:
    """The median over repeats of each repeat's tokens/s over plain decoding's in the same repeat (paired rounds:
    a repeat's runs follow one another, so a slow minute of the machine slows both sides of its ratio)."""
    ratios = [r["tokens_per_s"] / p["tokens_per_s"] for r, p in zip(runs, plain) if p["tokens_per_s"]]
    return statistics.median(ratios) if ratios else None


def _rows(config: BenchServeConfig) -> list[str]:
    """The report's rows: one per method, two for a learner outside ``--workload`` (its cold and warm pass)."""
    return [row for m in config.methods
            for row in ([f"{m} {COLD}", f"{m} {WARM}"] if _learns(m) and not config.workload else [m])]


def _report(config: BenchServeConfig, levels: list[int], runs: dict, texts: dict) -> dict[str, Any]:
    rows = []
    for level in levels:
        plain = {m: _median([r[m] for r in runs[(PLAIN, level)]]) for m in METRICS}
        for method in _rows(config):
            row = {"method": method, "concurrency": level,
                   **{m: _median([r[m] for r in runs[(method, level)]]) for m in METRICS},
                   "errors": sum(r["errors"] for r in runs[(method, level)]),
                   "identical": all(t == texts[(PLAIN, level)][0] for t in texts[(method, level)])}
            row["vs_plain"] = row["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else None
            row["vs_plain_paired"] = _paired(runs[(method, level)], runs[(PLAIN, level)])
            library = _median([r.get("library_tokens_per_s") for r in runs[(method, level)]])
            row["library_tokens_per_s"] = library
            row["vs_library"] = row["tokens_per_s"] / library if library else None
            rows.append(row)
    single = next(r for r in rows if r["method"] == PLAIN and r["concurrency"] == min(levels))
    step_s = single["itl_p50_s"]
    summary = {"bench": "serve", "model": config.model, "max_tokens": config.max_tokens, "repeats": config.repeats,
               "cpu": cpu_model(), "flags": sorted(cpu_flags() & {
                   "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "avx2"}),
               "single_stream_tokens_per_s": single["tokens_per_s"], "single_stream_step_s": step_s,
               "rows": [{k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]}
    for r in summary["rows"]:
        r["vs_single_stream_plain"] = (round(r["tokens_per_s"] / single["tokens_per_s"], 3)
                                       if single["tokens_per_s"] else None)
        r["itl_p99_vs_step"] = round(r["itl_p99_s"] / step_s, 3) if r["itl_p99_s"] and step_s else None
    return {"summary": summary, "command": "specdecode bench-serve " + " ".join(sys.argv[2:])}


def _print_table(report: dict[str, Any], log: Callable[[str], None]) -> None:
    log(f"{'method':<22}{'conc':>5}{'tok/s':>9}{'vs plain':>10}{'paired':>8}{'vs library':>11}{'vs 1-stream':>12}"
        f"{'TTFT p50':>10}{'ITL p50':>9}{'ITL p99':>9}{'p99/step':>9}  identical")
    for r in report["summary"]["rows"]:
        log(f"{r['method']:<22}{r['concurrency']:>5}{r['tokens_per_s']:>9.1f}{_shown(r['vs_plain']):>10}"
            f"{_shown(r['vs_plain_paired']):>8}{_shown(r['vs_library']):>11}{_shown(r['vs_single_stream_plain']):>12}"
            f"{_shown(r['ttft_p50_s'], ' ms'):>10}{_shown(r['itl_p50_s'], ' ms'):>9}{_shown(r['itl_p99_s'], ' ms'):>9}"
            f"{_shown(r['itl_p99_vs_step']):>9}  {r['identical']}")


def _shown(value: float | None, unit: str = "") -> str:
    """A ratio to two decimals, or seconds as whole milliseconds (``unit`` " ms"); "-" where a level gave none
    (no request of it succeeded, or its reference decoded nothing)."""
    if value is None:
        return "-"
    return f"{1e3 * value:.0f}{unit}" if unit else f"{value:.2f}"


def _write(report: dict[str, Any], out: Path, log: Callable[[str], None]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-serve.json").write_text(json.dumps(report, indent=1))
    s = report["summary"]
    lines = [f"# bench-serve: {s['model']}", "", f"`{report['command']}`", "",
             f"CPU: {s['cpu']}, flags {', '.join(s['flags'])}; {os.cpu_count()} cores; {s['max_tokens']} tokens per "
             f"request, greedy, {s['repeats']} repeat(s) (medians; \"paired\": the median of each repeat's own ratio). "
             "Single-stream plain decoding: "
             f"{s['single_stream_tokens_per_s']:.1f} tok/s, step (ITL p50) {_shown(s['single_stream_step_s'], ' ms')}."
             + (" Peer rows: llamacpp is llama-cpp-python's server (one request at a time), llamacpp-server "
                "llama.cpp's own with --max-running slots, both on the same GGUF; their answers may differ from ours "
                "at near-ties, so their identity is informational." if any(
                    _peer(r["method"]) for r in s["rows"]) else ""), "",
             "| method | concurrency | tok/s | library tok/s | vs library | vs plain | vs plain, paired | "
             "vs single-stream plain | TTFT p50 | ITL p50 | ITL p99 | ITL p99 / step | identical to plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        library = f"{r['library_tokens_per_s']:.1f}" if r["library_tokens_per_s"] else "-"
        lines.append(f"| {r['method']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {library} | "
                     f"{_shown(r['vs_library'])} | {_shown(r['vs_plain'])} | {_shown(r['vs_plain_paired'])} | "
                     f"{_shown(r['vs_single_stream_plain'])} | {_shown(r['ttft_p50_s'], ' ms')} | "
                     f"{_shown(r['itl_p50_s'], ' ms')} | {_shown(r['itl_p99_s'], ' ms')} | "
                     f"{_shown(r['itl_p99_vs_step'])} | {r['identical']} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plots")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(r["method"] for r in s["rows"]):
        rows = [r for r in s["rows"] if r["method"] == method]
        axes[0].plot([r["concurrency"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=method)
        timed = [r for r in rows if r["itl_p99_s"] is not None]  # (a level where every request failed has no latency)
        axes[1].plot([r["concurrency"] for r in timed], [1e3 * r["itl_p99_s"] for r in timed], marker="o", label=method)
    axes[0].set(xlabel="concurrent clients", ylabel="aggregate tokens/s", title="throughput")
    axes[1].set(xlabel="concurrent clients", ylabel="ms", title="inter-chunk latency p99")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "bench-serve.png", dpi=100)
    log(f"wrote {out}/bench-serve.json, report.md, bench-serve.png")
