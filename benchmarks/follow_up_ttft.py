"""Time to the first token of a conversation's next turn through `specdecode serve`, with the server's default flags
(prefix cache on) and with `--prefix-cache off`: the first turn carries a history of about N tokens, the follow-up
that history, the answer and a new question. Medians over repeats, each with a history of its own (so that a
repeat never reuses another's prefix).

    python benchmarks/follow_up_ttft.py --model smollm2-135m-instruct --shared 450,850,1700,2000 --repeats 3

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import openai

from specdecode.bench.serve_command import Server
from specdecode.models.fetch import fetch

WORDS = ("river mountain forest city engine garden window letter bridge harbor signal planet market silver "
         "winter summer orange castle valley meadow lantern compass anchor saddle").split()


def history(tokens: int, seed: int) -> list[dict[str, str]]:
    """A system message of about ``tokens`` tokens (about one per word) and a question."""
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(tokens))
    return [{"role": "system", "content": "Notes: " + text}, {"role": "user", "content": "Summarize the notes."}]


def ttft(client: openai.OpenAI, messages: list[dict[str, str]]) -> float:
    start = time.perf_counter()
    for chunk in client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0,
                                                stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            return time.perf_counter() - start
    return time.perf_counter() - start


def measure(model: str, flags: list[str], shared: list[int], repeats: int, threads: int) -> dict[int, dict]:
    server = Server("ttft", ["--model", model, "--served-model-name", "m", "--threads", str(threads),
                             "--max-len", "4096", "--log-level", "warning", *flags])
    server.wait_ready(timeout=600)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    try:
        out = {}
        for n in shared:
            firsts, follows, prompt = [], [], 0
            for r in range(repeats):
                messages = history(n, seed=1000 * n + r)
                firsts.append(ttft(client, messages))
                answer = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
                prompt = answer.usage.prompt_tokens
                follow = messages + [{"role": "assistant", "content": answer.choices[0].message.content},
                                     {"role": "user", "content": "Now in one word?"}]
                follows.append(ttft(client, follow))
            out[n] = {"prompt_tokens": prompt, "first_ttft_s": statistics.median(firsts),
                      "follow_up_ttft_s": statistics.median(follows)}
        return out
    finally:
        server.proc.kill()
        server.proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--shared", default="450,850,1700,2000", help="history lengths, in words (about tokens)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    model = str(fetch(args.model))
    shared = [int(n) for n in args.shared.split(",")]
    on = measure(model, [], shared, args.repeats, args.threads)
    off = measure(model, ["--prefix-cache", "off"], shared, args.repeats, args.threads)
    print(f"{'history':>8} {'prompt':>7} {'follow-up TTFT on':>18} {'off':>8} {'off/on':>7}")
    for n in shared:
        a, b = on[n], off[n]
        print(f"{n:>8} {a['prompt_tokens']:>7} {a['follow_up_ttft_s']:>17.3f}s {b['follow_up_ttft_s']:>7.3f}s "
              f"{b['follow_up_ttft_s'] / a['follow_up_ttft_s']:>6.1f}x")
    print(json.dumps({"model": args.model, "repeats": args.repeats, "threads": args.threads,
                      "prefix_cache_on": on, "prefix_cache_off": off}))


if __name__ == "__main__":
    main()
