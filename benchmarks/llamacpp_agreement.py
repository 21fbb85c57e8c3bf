"""Greedy agreement with llama.cpp on the same GGUF: our plain decoding of the bench's prompts against
llama-server's (``specdecode peers build`` first), token by token.

An answer agrees where one side's tokens are a prefix of the other's (llama-server's omit the end-of-sequence
token ours include). Where they differ, the first differing position is printed; a tie of the top two logits
there (different sums in another order) is the usual cause. Prints a table and one JSON line.

    python benchmarks/llamacpp_agreement.py --model qwen2.5-coder-1.5b-instruct --no-repack

``--no-repack`` starts llama-server without its AMX repacking (it crashes at load on some Xeons with AMX).
"""

from __future__ import annotations

import argparse
import json
import urllib.request

import torch

from specdecode.bench import llamacpp_tools
from specdecode.bench.child_server import Server
from specdecode.bench.prompts import default_prompts, select
from specdecode.engine import Engine
from specdecode.models.build import load_model
from specdecode.prompts import render


def llama_server_answers(gguf: str, prompts: list[list[int]], tokens: int, threads: int, no_repack: bool) -> list[list[int]]:
    binary = llamacpp_tools.require("llama-server")
    command = [str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", "{port}", "-t", str(threads), "-c", "4096",
               "--no-webui", *(["--no-repack"] if no_repack else [])]
    server = Server("llama-server", [], command, ready="/health")
    answers = []
    try:
        server.wait_ready(300)
        for ids in prompts:
            body = {"prompt": ids, "n_predict": tokens, "return_tokens": True, "cache_prompt": False,
                    "temperature": 0.0, "top_k": 1, "repeat_penalty": 1.0}
            request = urllib.request.Request(server.url + "/completion", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as reply:
                answers.append(json.loads(reply.read())["tokens"])
    finally:
        server.stop()
    return answers


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where the answers differ, or None where one is a prefix of the other."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="a registered name or a .gguf path")
    p.add_argument("--weights", default="auto")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--limit", type=int, default=1, help="prompts per bench category")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-repack", action="store_true", help="llama-server's --no-repack")
    args = p.parse_args()
    from specdecode.models.native import cpu_model

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, weights=args.weights)
    gguf = loaded.source  # the GGUF file a registered name resolves to
    prompts = select(default_prompts(), limit=args.limit)
    ids = [render(prompt, loaded.tokenizer) for prompt in prompts]
    engine = Engine(loaded.model, loaded.tokenizer)
    ours = [engine.generate(i, max_new_tokens=args.max_tokens).token_ids for i in ids]
    weights = loaded.model.weight_format
    del engine, loaded
    theirs = llama_server_answers(gguf, ids, args.max_tokens, args.threads, args.no_repack)
    rows = [{"category": prompt.category, "first_difference": first_difference(o, t), "ours": len(o), "theirs": len(t)}
            for prompt, o, t in zip(prompts, ours, theirs)]
    agree = sum(r["first_difference"] is None for r in rows)
    print(f"{cpu_model()}, {args.model} ({weights}), {args.max_tokens} tokens, greedy")
    print(f"{'category':16s} {'differs at':>10s} {'ours':>5s} {'theirs':>6s}")
    for r in rows:
        at = "-" if r["first_difference"] is None else str(r["first_difference"])
        print(f"{r['category']:16s} {at:>10s} {r['ours']:5d} {r['theirs']:6d}")
    print(f"agree on {agree}/{len(rows)}")
    print(json.dumps({"cpu": cpu_model(), "model": args.model, "weights": weights, "agree": agree,
                      "prompts": len(rows), "rows": rows}))


if __name__ == "__main__":
    main()
