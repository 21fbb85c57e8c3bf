"""Prometheus metrics of a served engine, under vLLM's names so that existing dashboards work.

Updated from the thread that steps the engine (``loop.py``): one call per sequence per step, and one
per step for the gauges, each on series looked up once (a ``labels()`` lookup per update was 3-5% of a served
step). Counters end in ``_total`` as exposed (prometheus_client appends it).

It does not serve HTTP (``app.py`` exposes :meth:`ServeMetrics.render` at ``/metrics``; under Ray,
:func:`merge_replicas` joins the replicas' texts into one view).
"""

from __future__ import annotations

from typing import Any, Mapping

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Metric,
                               disable_created_metrics, generate_latest)
from prometheus_client.parser import text_string_to_metric_families

from specdecode.batch.sequence import SequenceState
from specdecode.control import StepRecord

disable_created_metrics()  # no ``*_created`` series, as vLLM's /metrics

# Seconds; vLLM's buckets for these two histograms, cut to the range a CPU engine sees.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)


class ServeMetrics:
    """The server's metrics in a registry of their own (so that several servers in one process stay apart).

    Args:
        model_name: the ``model_name`` label every series carries.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, prefix_cache: bool = False) -> None:
        self.prefix_cache = prefix_cache  # whether admitted prompts were looked up in a prefix cache
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self._drafts = Counter("vllm:spec_decode_num_drafts", "Steps that verified a draft.", labels, registry=r)
        self._draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens.", labels, registry=r)
        self._accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Accepted draft tokens.", labels, registry=r)
        self._accepted_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted draft tokens by draft position (0-based).", labels + ["position"],
                                     registry=r)
        self._forced = Counter("specdecode:forced_draft_tokens", "Tokens a grammar forced, drafted ahead of the "
                               "drafter's (not in vllm:spec_decode_num_draft_tokens).", labels, registry=r)
        self._forced_accepted = Counter("specdecode:forced_accepted_tokens", "Forced draft tokens accepted.", labels,
                                        registry=r)
        self._running = Gauge("vllm:num_requests_running", "Requests being decoded.", labels, registry=r)
        self._waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a KV slot.", labels, registry=r)
        self._kv = Gauge("vllm:kv_cache_usage_perc", "Share of the KV cache's token room in use (0..1).", labels,
                         registry=r)
        self._learned_requests = Gauge("specdecode:drafter_learned_requests",
                                       "Finished requests the drafter keeps and drafts from (suffix's cache).", labels,
                                       registry=r)
        self._learned_bytes = Gauge("specdecode:drafter_learned_bytes", "Bytes of what the drafter keeps from "
                                    "finished requests.", labels, registry=r)
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first generated token.", labels,
                               buckets=TTFT_BUCKETS, registry=r)
        self._itl = Histogram("vllm:inter_token_latency_seconds",
                              "Time between a request's successive steps that produced tokens.", labels,
                              buckets=ITL_BUCKETS, registry=r)
        self._prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                       labels, registry=r)
        self._prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens whose K/V came from the prefix cache.",
                                    labels, registry=r)
        self._prefix_hit_requests = Counter("specdecode:prefix_cache_hit_requests",
                                            "Requests that reused a stored prefix.", labels, registry=r)
        self._prefix_evicted = Counter("specdecode:prefix_cache_evicted_tokens",
                                       "Tokens the prefix cache dropped to make room (least recently used first).",
                                       labels, registry=r)
        self._prefix_bytes = Gauge("specdecode:prefix_cache_bytes", "Bytes the prefix cache holds.", labels,
                                   registry=r)
        self._prompt = Counter("vllm:prompt_tokens", "Prompt tokens of admitted requests.", labels, registry=r)
        self._generated = Counter("vllm:generation_tokens", "Generated tokens.", labels, registry=r)
        self._label = {"model_name": model_name}
        self._series: dict[Any, Any] = {}  # metric -> its series of this model_name (accepted_pos's: apart)
        self._positions: list[Any] = []  # vllm:spec_decode_num_accepted_tokens_per_pos's series, by position
        self._last: dict[int, float] = {}  # sequence id -> when its previous tokens came
        self._evicted_seen = 0  # the prefix cache's evicted tokens already counted

    def _of(self, metric: Counter | Gauge | Histogram) -> Any:
        """``metric``'s series of this server's model_name, looked up once."""
        series = self._series.get(metric)
        if series is None:
            series = self._series[metric] = metric.labels(**self._label)
        return series

    def _at(self, position: int) -> Any:
        while len(self._positions) <= position:
            self._positions.append(self._accepted_pos.labels(position=str(len(self._positions)), **self._label))
        return self._positions[position]

    def admitted(self, seq: SequenceState) -> None:
        self._of(self._prompt).inc(len(seq.request.prompt_ids))
        if self.prefix_cache:
            hit = seq.stats.prefix_hit_tokens
            self._of(self._prefix_queries).inc(len(seq.request.prompt_ids) - 1)  # the last is fed
            self._of(self._prefix_hits).inc(hit)
            if hit:
                self._of(self._prefix_hit_requests).inc()

    def stepped(self, seq: SequenceState, record: StepRecord, emitted: int, now: float) -> None:
        """One sequence's step: its draft, what was accepted and the tokens it emitted at ``now``."""
        if record.drafted:
            self._of(self._drafts).inc()
            self._of(self._draft_tokens).inc(record.drafted)
            self._of(self._accepted).inc(record.accepted)
            for position in range(record.accepted):
                self._at(position).inc()
        if record.forced:
            self._of(self._forced).inc(record.forced)
            self._of(self._forced_accepted).inc(record.forced_accepted)
        if emitted:
            self._of(self._generated).inc(emitted)
            previous = self._last.get(seq.id)
            if previous is None:
                self._of(self._ttft).observe(now - seq.arrival)
            else:
                self._of(self._itl).observe(now - previous)
            self._last[seq.id] = now

    def finished(self, seq: SequenceState) -> None:
        self._last.pop(seq.id, None)

    def gauges(self, running: int, waiting: int, kv_usage: float, learned: tuple[int, int] = (0, 0),
               prefix: tuple[int, int] = (0, 0)) -> None:
        """Per step: requests running and waiting, the KV cache's use, the drafter's (requests, bytes) kept from
        finished requests and the prefix cache's (bytes, tokens evicted so far)."""
        self._of(self._prefix_bytes).set(prefix[0])
        evicted = prefix[1] - self._evicted_seen
        if evicted > 0:
            self._of(self._prefix_evicted).inc(evicted)
            self._evicted_seen = prefix[1]
        self._of(self._running).set(running)
        self._of(self._waiting).set(waiting)
        self._of(self._kv).set(kv_usage)
        self._of(self._learned_requests).set(learned[0])
        self._of(self._learned_bytes).set(learned[1])

    def render(self) -> bytes:
        return generate_latest(self.registry)


def merge_replicas(texts: Mapping[str, bytes], label: str = "replica") -> bytes:
    """One Prometheus exposition from several servers' (``{replica: text}``): each series gets a ``label``
    naming its replica, and each metric family appears once."""
    families: dict[str, Metric] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text.decode()):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, label: replica}, sample.value, sample.timestamp)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    """A collector that yields given metric families (what ``merge_replicas`` renders)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families
