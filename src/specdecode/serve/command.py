"""``specdecode serve``: load a model, build the batch engine and serve the OpenAI-compatible API with uvicorn.

Flags as for ``generate`` where they apply (model, kernel path, drafter and its model or head, gamma, KV
cache; ``drafter_setup.py`` builds the drafter for both), plus the
server's (``--host``, ``--port``) and the scheduler's (``--max-running``, ``--max-waiting``,
``--max-rows``, ``--max-len``). It does not define the API (``app.py``) or the step loop (``loop.py``).
"""

from __future__ import annotations

import argparse
import gc
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from specdecode.argtypes import add_kv_arguments, byte_size, cache_configs, gamma, positive_float, positive_int
from specdecode.batch.executor import BatchEngine
from specdecode.batch.scheduler import SchedulerConfig
from specdecode.control import GAMMA_POLICIES
from specdecode.drafter_setup import add_drafter_arguments, drafter_factory, drafter_kind
from specdecode.drafters import base_kind
from specdecode.control.config import SpeculativeConfig

if TYPE_CHECKING:
    from fastapi import FastAPI

    from specdecode.serve.loop import EngineLoop
    from specdecode.serve.metrics import ServeMetrics

SHUTDOWN_GRACE_S = 30  # running requests may finish for this long after SIGTERM, then they are cancelled


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: the --model value)")
    add_drafter_arguments(p)
    p.add_argument("--gamma", type=gamma, default="adaptive",
                   help=f"tokens drafted per step (0 = off) or a controller: {', '.join(GAMMA_POLICIES)} (default adaptive)")
    p.add_argument("--gamma-max", type=positive_int, default=8, help="upper bound of the controllers")
    p.add_argument("--controller-file", default=None, metavar="FILE",
                   help="acceptance models for --gamma confidence|adaptive (default: the shipped one)")
    p.add_argument("--max-running", type=positive_int, default=4,
                   help="requests decoded together, each holding one KV slot of --max-len tokens (default 4)")
    p.add_argument("--max-waiting", type=int, default=64,
                   help="requests queued beyond those; more are refused with 429 (default 64)")
    p.add_argument("--max-rows", type=positive_int, default=None,
                   help="rows per target forward while requests decode: their fed tokens, then prompt rows, then "
                        "drafts, which shrink to fit; bounds the time between tokens (default: 2 x --max-running)")
    p.add_argument("--prefill-chunk", type=positive_int, default=SchedulerConfig.prefill_chunk,
                   help="prompt rows per forward while no request decodes (default "
                        f"{SchedulerConfig.prefill_chunk})")
    p.add_argument("--max-len", type=positive_int, default=None,
                   help="tokens per request, prompt + completion (default: the model's context, at most 4096)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_kv_arguments(p)
    r = p.add_argument_group("Ray Serve (pip install 'specdecode[ray]')")
    r.add_argument("--ray", action="store_true",
                   help="serve through Ray Serve's HTTP proxy on --host/--port: --replicas engine replicas behind one "
                        "ingress, routed by prompt prefix")
    r.add_argument("--replicas", type=positive_int, default=1, help="engine replicas with --ray (default 1)")
    r.add_argument("--cpus-per-replica", type=positive_float, default=1.0,
                   help="Ray CPUs each replica reserves; its kernels' threads unless --threads (default 1)")
    r.add_argument("--ingress-replicas", type=positive_int, default=1,
                   help="replicas of the ingress that relays every request and streamed chunk (default 1)")
    r.add_argument("--memory-per-replica", type=byte_size, default=None, metavar="SIZE",
                   help="memory each replica reserves from Ray's scheduler, e.g. 2G (default: none reserved)")
    r.add_argument("--ray-address", default=None,
                   help="the Ray cluster to join: auto = the one `ray start` began on this machine, or HOST:PORT "
                        "(default: $RAY_ADDRESS, else a new local cluster, shut down on exit)")
    r.add_argument("--routing", choices=["prefix", "pow2"], default="prefix",
                   help="prefix = requests sharing a prompt prefix go to the replica that served it while its queue "
                        "is not much longer; pow2 = Ray's power of two choices (default prefix)")


@dataclass
class Served:
    """What ``specdecode serve`` runs: the application and the loop stepping its engine (not yet started)."""

    app: "FastAPI"
    loop: "EngineLoop"
    metrics: "ServeMetrics"
    name: str
    kind: str


def build_server(args: argparse.Namespace, log: Callable[[str], None], lifespan=None) -> Served:
    """Loads the model, builds and warms the batch engine and the API over it from ``serve``'s flags; the
    Ray replicas (``ray_app.py``) build theirs with it too."""
    try:
        from specdecode.serve.app import build_app
    except ImportError as exc:
        raise ValueError(f"specdecode serve needs the serve extra ({exc.name} is missing): "
                         "pip install 'specdecode[serve]'") from None
    from specdecode.models.build import load_model
    from specdecode.serve.loop import EngineLoop
    from specdecode.serve.metrics import ServeMetrics

    scheduler = SchedulerConfig(args.max_running, args.max_waiting, args.max_rows, args.prefill_chunk)
    spec = SpeculativeConfig(args.gamma, args.gamma_max, args.controller_file)
    kind = drafter_kind(args)
    cache, draft_cache = cache_configs(args, draft=base_kind(kind) in ("draft", "eagle"))
    loaded = load_model(args.model, args.dtype, args.device, progress=log, linear=args.linear, weights=args.weights)
    new_drafter = drafter_factory(args, loaded, draft_cache, log)
    name = args.served_model_name or args.model
    metrics = ServeMetrics(name)
    engine = BatchEngine(loaded.model, loaded.tokenizer, new_drafter, spec, cache, scheduler, args.max_len)
    log(f"warming up ({args.max_running} slots of {engine.max_len} tokens, KV {engine.cache.nbytes / 2**20:.0f} MiB) ...")
    engine.warmup()
    engine.observer = metrics  # the warm-up request is not counted
    loop = EngineLoop(engine, on_step=lambda e: metrics.gauges(len(e.scheduler.running), len(e.scheduler.waiting),
                                                               e.kv_usage))
    return Served(build_app(loop, name, metrics, lifespan=lifespan), loop, metrics, name, kind)


def run_command(args: argparse.Namespace, log: Callable[[str], None]) -> int:
    if args.ray:
        from specdecode.serve.ray_command import run_ray

        return run_ray(args, log)
    try:
        import uvicorn
    except ImportError as exc:
        raise ValueError(f"specdecode serve needs the serve extra ({exc.name} is missing): "
                         "pip install 'specdecode[serve]'") from None
    @asynccontextmanager
    async def lifespan(app):
        app.state.loop.start()
        yield
        app.state.accepting = False
        app.state.loop.stop(timeout=SHUTDOWN_GRACE_S)

    served = build_server(args, log, lifespan=lifespan)
    gc.collect()
    gc.freeze()  # the model and engine live as long as the server: keep them out of every collection's scan
    log(f"serving {served.name} on http://{args.host}:{args.port}/v1 (drafter {served.kind}, gamma {args.gamma})")
    uvicorn.run(served.app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    return 0
