"""``specdecode serve``'s flags and the :class:`~specdecode.serve.config.ServeConfig` they make.

Flags as for ``generate`` where they apply (model, kernel path, drafter and its model or head, gamma, KV
cache), plus the server's (``--host``, ``--port``), the scheduler's (``--max-running``, ``--max-waiting``,
``--max-rows``, ``--max-len``) and Ray Serve's (``--ray``, ``--replicas`` ...). The CLI's ``serve`` and
:func:`serve_flags` (Python callers, Ray Serve config files) parse them alike. It runs nothing.
"""

from __future__ import annotations

import argparse

from specdecode.argtypes import byte_size, positive_float, positive_int
from specdecode.batch.scheduler import SchedulerConfig
from specdecode.control.config import SpeculativeConfig
from specdecode.flags import (add_drafter_arguments, add_gamma_arguments, add_kv_arguments, add_model_arguments,
                              cache_configs, drafter_config, target_config)
from specdecode.serve.config import ROUTINGS, RayConfig, ServeConfig
from specdecode.serve.guard import API_KEY_ENV, HttpPolicy


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every ``serve`` flag, the shared model flags first."""
    add_model_arguments(p, threads_default="every usable core, but one from 8 cores up: that one stays with the "
                                           "HTTP side")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: the --model value)")
    add_drafter_arguments(p)
    add_gamma_arguments(p)
    p.add_argument("--max-running", type=positive_int, default=8,
                   help="requests decoded together, each holding one KV slot of --max-len tokens (default 8: on 2 "
                        "cores 8 clients then run 1.2x faster than 4, where 4 slots queued half of them)")
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
    p.add_argument("--api-key", default=None,
                   help=f"clients must send `Authorization: Bearer KEY`; every route but /health answers 401 "
                        f"without it (default: ${API_KEY_ENV}, else no key)")
    p.add_argument("--metrics-public", action="store_true", help="/metrics answers without the API key")
    p.add_argument("--max-body-bytes", type=byte_size, default=HttpPolicy.max_body_bytes, metavar="SIZE",
                   help="the largest request body, e.g. 8M; larger ones get a 413 (default 8M)")
    p.add_argument("--request-timeout", type=positive_float, default=None, metavar="SECONDS",
                   help="cancel a request still running this long after it was accepted (read, checked and "
                        "tokenized): a 504, or an error event ending its stream (default: no deadline)")
    add_kv_arguments(p, prefix_cache=True)
    _add_ray_arguments(p)


def _add_ray_arguments(p: argparse.ArgumentParser) -> None:
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
    r.add_argument("--routing", choices=ROUTINGS, default="prefix",
                   help="prefix = requests sharing a prompt prefix go to the replica that served it while its queue "
                        "is not much longer; pow2 = Ray's power of two choices (default prefix)")


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The server :func:`add_arguments`' flags describe; contradictory flags raise ValueError (naming them)
    before anything is loaded."""
    scheduler = SchedulerConfig(args.max_running, args.max_waiting, args.max_rows, args.prefill_chunk)
    speculation = SpeculativeConfig(args.gamma, args.gamma_max, args.controller_file, args.long_max)
    drafter = drafter_config(args)
    cache, draft_cache = cache_configs(args, draft=drafter.has_draft_cache)
    ray = RayConfig(args.replicas, args.cpus_per_replica, args.ingress_replicas, args.memory_per_replica,
                    args.routing, address=args.ray_address) if args.ray else None
    http = HttpPolicy(HttpPolicy.key_from(args.api_key), args.metrics_public, args.max_body_bytes,
                      args.request_timeout)
    return ServeConfig(target_config(args), drafter, speculation, cache, draft_cache, scheduler, args.max_len,
                       args.served_model_name, args.host, args.port, args.log_level, args.threads, ray, http)


def serve_flags(flags: list[str]) -> ServeConfig:
    """``specdecode serve``'s flags (e.g. ``["--model", "smollm2-135m", "--drafter", "ngram"]``) as its config;
    bad flags raise ValueError (not argparse's exit)."""
    parser = argparse.ArgumentParser(prog="specdecode serve")
    add_arguments(parser)
    try:
        args = parser.parse_args(flags)
    except SystemExit:
        raise ValueError(f"bad specdecode serve flags: {' '.join(flags)} (see `specdecode serve --help`)") from None
    return serve_config(args)
