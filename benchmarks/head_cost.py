"""What one drafted token of a trained head costs, next to a target decode step (docs/benchmarks/history.md, "Trained
draft heads": the draft vocabulary swept).

On the real SmolLM2 (or ``--model``) and its shipped head (or ``--head``), after a ``--context``-token prompt:
a target decode step (1 row, logits of its whole vocabulary), then, for each draft vocabulary size N, one
drafted token: the head's layer on its own last prediction (``EagleHead.step``, rolled back after) and the
draft vocabulary's logits (``VocabHead``) with the greedy pick. Each drafted token is timed twice: right after
a target step (``first``: the target's forward has pushed the head's weights out of the caches, as before
the first token of every draft) and right after itself (``next``: as for the later tokens of a draft).
Rounds go through every size in turn, so the machine's drift hits every row alike; medians of ``--repeats``
rounds. Prints a table, then one JSON line. Not part of the test suite (timings).

    .venv/bin/python benchmarks/head_cost.py --vocab 0,32768,16384,8192,4096 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch

from specdecode.drafters import EagleDrafter
from specdecode.drafters.head_loader import load_head_drafter
from specdecode.heads import shipped_head
from specdecode.kv.cache import CacheConfig
from specdecode.models.build import load_model
from specdecode.models.native import cpu_model
from specdecode.models.rows import LogitRows


def _sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--head", default=None, help="an EAGLE head file (default: the one shipped for --model)")
    p.add_argument("--vocab", type=_sizes, default=[0, 32768, 16384, 8192, 4096], help="draft vocabularies (0 = all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=200, help="prompt tokens before the timed calls")
    p.add_argument("--repeats", type=int, default=300)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    target = lm.model
    path = args.head or shipped_head(target, "eagle")
    if path is None:
        raise SystemExit(f"no EAGLE head ships for {args.model}; pass --head FILE")
    drafters = {n: load_head_drafter(path, target, draft_vocab=n) for n in args.vocab}
    if not all(isinstance(d, EagleDrafter) for d in drafters.values()):
        raise SystemExit(f"{path}: not an EAGLE head (this script times EAGLE heads' drafted tokens)")
    prompt = torch.randint(0, target.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))

    with torch.inference_mode():
        cache = target.new_cache(CacheConfig(max_len=args.context + 64))
        layers = next(iter(drafters.values())).feature_layers
        feats = target(prompt, cache, logits=LogitRows.LAST, features=layers).features
        token = torch.tensor([[int(prompt[0, -1])]])

        def target_step() -> None:
            target(token, cache, logits=LogitRows.LAST)
            cache.trim(0, args.context)

        tokens: dict[str, Callable[[], None]] = {}
        for n, drafter in drafters.items():
            head = drafter.head
            head_cache = head.new_cache(CacheConfig(max_len=args.context + 64))
            state = head.step(target.embed(prompt[:, 1:]), head.lift(feats[:, :-1]), head_cache)[:, -1:]

            def head_token(head=head, head_cache=head_cache, state=state, vocab=drafter.vocab) -> None:
                out = head.step(target.embed(token), state, head_cache)
                int(vocab(out[0, -1]).argmax())
                head_cache.trim(0, args.context - 1)

            tokens[str(n or "all")] = head_token

        times: dict[str, list[float]] = {"target step": []}
        for name in tokens:
            times[f"first {name}"], times[f"next {name}"] = [], []

        def timed(name: str, call: Callable[[], None]) -> None:
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)

        for round_ in range(args.repeats + 10):  # the first 10 rounds warm up
            for name, head_token in tokens.items():
                timed("target step", target_step)
                timed(f"first {name}", head_token)
                timed(f"next {name}", head_token)
            if round_ < 10:
                for t in times.values():
                    t.clear()

    step = statistics.median(times["target step"])
    rows = {name: {"ms": statistics.median(t) * 1e3, "of_step": statistics.median(t) / step} for name, t in times.items()}
    print(f"{cpu_model()}, {args.threads} threads, context {args.context}, medians of {args.repeats} rounds")
    print(f"{'call (draft vocabulary)':<24} {'ms':>7} {'of a step':>10}")
    for name, row in rows.items():
        print(f"{name:<24} {row['ms']:7.3f} {row['of_step']:10.3f}")
    print(json.dumps({"cpu": cpu_model(), "threads": args.threads, "context": args.context, "head": str(path),
                      "calls": {k: {kk: round(vv, 4) for kk, vv in v.items()} for k, v in rows.items()}}))


if __name__ == "__main__":
    main()
