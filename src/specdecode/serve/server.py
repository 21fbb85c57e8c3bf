"""The server a :class:`~specdecode.serve.config.ServeConfig` describes: the model loaded, the batch engine
built and warmed up, its loop and the API over it (not yet started). ``specdecode serve`` runs it under
uvicorn (``command.py``); each Ray replica builds its own (``ray_app.py``).

It does not define the API (``app.py``), step the engine (``loop.py``) nor listen on a port.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from specdecode.batch.executor import BatchEngine
from specdecode.drafter_setup import drafter_factory
from specdecode.grammar import GrammarError
from specdecode.serve.config import ServeConfig
from specdecode.serve.kernel_team import on_passing_thread, use_kernel_threads

if TYPE_CHECKING:
    from fastapi import FastAPI

    from specdecode.serve.loop import EngineLoop
    from specdecode.serve.metrics import ServeMetrics

SHUTDOWN_GRACE_S = 30  # running requests may finish for this long after SIGTERM, then they are cancelled


# How long a thread waiting for the GIL lets its holder run on (Python's default: 5 ms). A forward releases it; when
# one ends while the HTTP thread is streaming, the engine thread waited up to the whole interval, about a step:
# at 8 streams 0.5 ms served n-gram drafting 12% and `auto` 7% more tokens/s, plain 2% (docs/benchmarks/history.md,
# "The GIL's switch interval").
GIL_SWITCH_S = 0.0005


@dataclass
class Served:
    """What ``specdecode serve`` runs: the application and the loop stepping its engine (not yet started)."""

    app: "FastAPI"
    loop: "EngineLoop"
    metrics: "ServeMetrics"
    name: str
    kind: str


def build_server(config: ServeConfig, log: Callable[[str], None], lifespan: Callable | None = None,
                 threads: int | None = None) -> Served:
    """Loads the model, builds and warms the batch engine and the API over it; ``lifespan`` starts and
    stops the loop with the application (see ``command.py``). ``threads``: the kernels' threads (default
    ``config.kernel_threads``), all on the engine loop's thread; the calling thread keeps one (``kernel_team.py``).

    Raises:
        ValueError: the serve extra is missing, or the drafter's head cannot be found.
    """
    try:
        from specdecode.serve.app import build_app
    except ImportError as exc:
        raise ValueError(f"specdecode serve needs the serve extra ({exc.name} is missing): "
                         "pip install 'specdecode[serve]'") from None
    from specdecode.serve.loop import EngineLoop
    from specdecode.serve.metrics import ServeMetrics

    threads = threads or config.kernel_threads
    sys.setswitchinterval(GIL_SWITCH_S)
    use_kernel_threads(1)
    engine = on_passing_thread(lambda: _warm_engine(config, log), threads)
    metrics = ServeMetrics(config.name, prefix_cache=config.cache.prefix_cache)
    engine.observer = metrics  # the warm-up request is not counted
    loop = EngineLoop(engine, threads, on_step=lambda e: metrics.gauges(
        len(e.scheduler.running), len(e.scheduler.waiting), e.kv.usage, e.learned,
        (e.memory.prefix_bytes, e.memory.prefix_evicted_tokens)))
    return Served(build_app(loop, config.name, metrics, config.http, lifespan=lifespan), loop, metrics, config.name,
                  config.drafter.kind)


def _warm_engine(config: ServeConfig, log: Callable[[str], None]) -> BatchEngine:
    """The model loaded and the batch engine built and warmed up."""
    loaded = config.target.load(progress=log)
    new_drafter = drafter_factory(config.drafter, config.target, loaded, config.draft_cache, log)
    engine = BatchEngine(loaded.model, loaded.tokenizer, new_drafter, config.speculation, config.cache,
                         config.scheduler, config.max_len)
    log(f"warming up ({config.scheduler.max_running} slots of {engine.max_len} tokens, "
        f"KV {engine.kv.cache.nbytes / 2**20:.0f} MiB) ...")
    engine.warmup()
    try:
        tick = time.perf_counter()
        engine.grammar_compiler()  # made now: the first request with a grammar would wait for it (0.2-0.9 s)
        log(f"structured outputs ready ({time.perf_counter() - tick:.1f} s)")
    except GrammarError as exc:
        log(f"structured outputs are unavailable: {exc}")
    return engine
