"""A load generator for an OpenAI-compatible server: streamed chat requests from a fixed number of concurrent
clients (a closed loop: each client sends its next request when the previous one ends).

Per request it records the time to the first content, the gaps between content chunks (one chunk per
engine step that produced text), the completion tokens (``usage``, else one per chunk) and the text. Client threads use
``http.client`` only, so the generator costs the machine little next to the server it measures.

It does not start servers or write reports (``serve_command.py``).
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

T = TypeVar("T")


@dataclass
class RequestResult:
    """One streamed request as the client saw it.

    Args:
        index: position in the request list.
        text: the streamed content, joined.
        tokens: completion tokens (from the final usage chunk; a server that sends none, such as
            llama-cpp-python's, streams one token per chunk, and the chunks are counted).
        ttft_s: seconds from sending to the first content.
        gaps_s: seconds between successive content chunks.
        latency_s: seconds from sending to the end of the stream.
        error: what went wrong (None when the request succeeded).
    """

    index: int
    text: str = ""
    tokens: int = 0
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    error: str | None = None


def stream_chat(host: str, port: int, body: dict[str, Any], index: int, timeout: float = 600.0) -> RequestResult:
    """Sends one streamed chat completion and times its chunks."""
    result = RequestResult(index)
    payload = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}})
    start = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", payload, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            result.error = f"HTTP {response.status}: {response.read()[:200].decode(errors='replace')}"
            return result
        last, pieces = None, []
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                result.error = event["error"]["message"]
                break
            if event.get("usage"):
                result.tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    now = time.perf_counter()
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.gaps_s.append(now - last)
                    last = now
                    pieces.append(content)
        result.text = "".join(pieces)
        result.tokens = result.tokens or len(pieces)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
        result.latency_s = time.perf_counter() - start
    return result


def closed_loop(count: int, concurrency: int, work: Callable[[int], T]) -> tuple[list[T], float]:
    """``work(i)`` for i in 0..count-1 from ``concurrency`` client threads, each taking the next index when its
    previous one ends; returns the results in index order and the wall seconds."""
    results: list[T | None] = [None] * count
    lock = threading.Lock()
    next_index = [0]

    def client() -> None:
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= count:
                return
            results[i] = work(i)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def run_level(host: str, port: int, bodies: list[dict[str, Any]], concurrency: int) -> tuple[list[RequestResult], float]:
    """Sends every body with ``concurrency`` clients; returns the results (in body order) and the wall seconds."""
    return closed_loop(len(bodies), concurrency, lambda i: stream_chat(host, port, bodies[i], i))


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    """Aggregate tokens/s, TTFT and inter-chunk latency percentiles of one level's run."""
    ok = [r for r in results if r.error is None]
    gaps = [g for r in ok for g in r.gaps_s]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tokens = sum(r.tokens for r in ok)
    return {"requests": len(results), "errors": len(results) - len(ok), "tokens": tokens, "wall_s": wall_s,
            "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
            "itl_mean_s": statistics.fmean(gaps) if gaps else None}
