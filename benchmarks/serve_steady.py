"""Steady-state throughput of a running server: closed-loop streaming chat clients for a fixed time (docs/benchmarks/
history.md, "Serving under load on AMD Zen 5").

``bench-serve`` times a fixed set of requests per pass, so a pass also measures its ramp-down (the last requests
running at lower concurrency); this keeps ``--concurrency`` clients busy for ``--seconds`` instead, each sending
the packaged chat suites' next prompt (``--limit`` per category, in turn) as soon as its last answer ended, and
counts the completion tokens of every answer that ended in the window (from the final ``usage`` chunk). Start
the server first (``specdecode serve --served-model-name m ...``); run it once untimed to warm the server.
Prints one line of tokens/s, then one JSON line.

    python benchmarks/serve_steady.py --port 8000 --concurrency 8 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

from specdecode.bench.prompts import CATEGORIES, packaged_prompts, select


async def _client(url: str, bodies: list[dict], first: int, step: int, stop: float, tokens: list[int]) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        k = first
        while time.monotonic() < stop:
            body = bodies[k % len(bodies)]
            k += step
            async with client.stream("POST", url, json=body) as reply:
                reply.raise_for_status()
                async for line in reply.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            tokens[0] += usage["completion_tokens"]


async def _run(url: str, bodies: list[dict], concurrency: int, seconds: float) -> tuple[int, float]:
    tokens = [0]
    start = time.monotonic()
    await asyncio.gather(*(_client(url, bodies, i, concurrency, start + seconds, tokens) for i in range(concurrency)))
    return tokens[0], time.monotonic() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default="m", help="the server's --served-model-name")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--limit", type=int, default=2, help="prompts per chat category")
    args = p.parse_args()
    prompts = select(packaged_prompts(CATEGORIES), None, args.limit)
    bodies = [{"model": args.model, "messages": p.messages or [{"role": "user", "content": p.prompt}],
               "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}} for p in prompts]
    url = f"http://127.0.0.1:{args.port}/v1/chat/completions"
    tokens, wall = asyncio.run(_run(url, bodies, args.concurrency, args.seconds))
    print(f"tokens/s {tokens / wall:.1f}")
    print(json.dumps({"concurrency": args.concurrency, "seconds": wall, "tokens": tokens,
                      "tokens_per_s": tokens / wall}))


if __name__ == "__main__":
    main()
