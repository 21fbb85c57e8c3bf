"""The library as the reference of ``bench-serve``: the same requests through ``BatchEngine.run`` in this
process, no HTTP, so that a server's tokens/s can be read against the engine's own.

One engine per method and concurrency level: a level of c closed-loop clients keeps at most c sequences
running, so the library's engine decodes at most c at a time. Its cache shares prompt prefixes, as a server's
does by default, and a run may first serve every request for one token (as bench-serve does to each server), so
that its prompts come from that cache. It does not start servers or send requests
(``serve_command.py``, ``load.py``).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from specdecode.batch.executor import BatchEngine
from specdecode.batch.scheduler import SchedulerConfig
from specdecode.control.config import SpeculativeConfig
from specdecode.drafter_setup import DrafterConfig, drafter_factory
from specdecode.flags import gamma
from specdecode.kv.cache import CacheConfig
from specdecode.models.build import LoadedModel
from specdecode.prompts import render
from specdecode.target import TargetConfig


class Library:
    """The target loaded once in this process, with an engine per (method, level) made on first use.

    Args:
        target: how the servers load the target (the library loads it alike).
        log: progress lines.
    """

    def __init__(self, target: TargetConfig, log: Callable[[str], None]) -> None:
        log(f"loading {target.model} for the library's reference runs ...")
        self.target_config = target
        self.target: LoadedModel = target.load()
        self.log = log
        self._engines: dict[tuple[str, int], BatchEngine] = {}

    def requests(self, prompts: list[Any], count: int) -> list[dict[str, Any]]:
        """``count`` requests (token ids and prediction), cycling through ``prompts`` as the servers' chat
        requests do."""
        return [dict(prompt=render(p, self.target.tokenizer), prediction=p.prediction)
                for p in (prompts[i % len(prompts)] for i in range(count))]

    def store_prompts(self, method: str, level: int, requests: list[dict[str, Any]], fresh: bool = False) -> None:
        """Serves each of ``requests`` for one token, untimed, on ``method``'s engine at ``level`` (a new one with
        ``fresh``): their prompts are then in its prefix cache, and one token taught a learner nothing."""
        if fresh:
            self._engines.pop((method, level), None)
        self._engine(method, level).run([dict(r, max_new_tokens=1) for r in requests])

    def tokens_per_s(self, method: str, level: int, requests: list[dict[str, Any]], max_tokens: int,
                     fresh: bool = False) -> tuple[float, list[str]]:
        """Aggregate tokens/s of ``requests`` served at most ``level`` at a time by ``method`` (``none`` or
        ``DRAFTER:GAMMA``), greedy, and each request's text; ``fresh``: on a new engine (a drafter that learns
        across requests then knows none of an earlier run's)."""
        if fresh:
            self._engines.pop((method, level), None)
        engine = self._engine(method, level)
        start = time.perf_counter()
        results = engine.run([dict(r, max_new_tokens=max_tokens) for r in requests])
        seconds = time.perf_counter() - start
        return sum(len(r.token_ids) for r in results) / seconds, [r.text for r in results]

    def _engine(self, method: str, level: int) -> BatchEngine:
        if (method, level) not in self._engines:
            kind, _, g = method.partition(":")
            cache = CacheConfig(prefix_cache=True)  # (a server's default)
            new = drafter_factory(DrafterConfig(kind=kind), self.target_config, self.target, cache, self.log)
            spec = SpeculativeConfig(gamma=gamma(g) if g else 0)
            engine = BatchEngine(self.target.model, self.target.tokenizer, new, spec, cache=cache,
                                 scheduler=SchedulerConfig(max_running=level))
            engine.warmup()
            self._engines[(method, level)] = engine
        return self._engines[(method, level)]
