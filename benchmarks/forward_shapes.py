"""What a forward costs by its shape: rows per sequence, sequences and context (docs/benchmarks/history.md,
"Attention in one pass over the cache").

A verification forward's rows each attend over their sequence's context, so its cost grows with the context as well
as with the rows; a batch step holds one row per sequence, each over its own context. This times forwards of given
shapes (``--shapes``: rows per sequence, one sequence per number, e.g. ``1x8`` = 8 sequences of 1 row, ``2+1x7`` =
one sequence of 2 rows beside 7 of 1) after ``--context`` tokens in every slot, the shapes interleaved and each
rolled back, medians over ``--repeats``; then the prefill of ``--prefill`` tokens in chunks of 512. Compare code
versions in turns (``PYTHONPATH=<a worktree>/src``): the host's memory speed moves between runs. Prints a table,
then one JSON line.

    .venv/bin/python benchmarks/forward_shapes.py --context 1000 --shapes 1,2,4,8
    .venv/bin/python benchmarks/forward_shapes.py --context 300 --shapes 1x8,2+1x7,9
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdecode.kv.cache import CacheConfig
from specdecode.models.build import load_model
from specdecode.models.native import cpu_model
from specdecode.models.rows import LogitRows
from specdecode.timing import interleaved_timings

PREFILL_CHUNK = 512


def parse_shape(text: str) -> list[int]:
    """``"2+1x7"`` -> [2, 1, 1, 1, 1, 1, 1, 1]: rows per sequence."""
    rows: list[int] = []
    for part in text.split("+"):
        n, _, times = part.partition("x")
        rows += [int(n)] * int(times or 1)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--context", type=int, default=1000, help="tokens in each slot before the timed forwards")
    p.add_argument("--shapes", default="1,2,4,8", help="comma list of shapes (see the module's docstring)")
    p.add_argument("--prefill", type=int, default=1024, help="prompt tokens timed in chunks of 512 (0: none)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model).model
    shapes = {text: parse_shape(text) for text in args.shapes.split(",")}
    slots = max(len(rows) for rows in shapes.values())
    longest = max(args.context + max(max(rows) for rows in shapes.values()), args.prefill)
    cache = model.new_cache(CacheConfig(max_len=-(-(longest + 1) // 64) * 64, slots=slots))
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    with torch.inference_mode():
        for slot in range(slots):
            model.forward_rows(torch.randint(0, vocab, (args.context,), generator=g), cache, (slot,), (args.context,),
                               logits=LogitRows.NONE)

        def forward_s(i: int) -> float:  # shape i's forward with every row's logits (as verification), rolled back
            rows = list(shapes.values())[i]
            n = sum(rows)
            tokens = torch.randint(0, vocab, (n,), generator=g)
            start = time.perf_counter()
            out = model.forward_rows(tokens, cache, tuple(range(len(rows))), tuple(rows), logits=LogitRows.at(
                torch.arange(n)))
            out.logits.argmax(-1)
            seconds = time.perf_counter() - start
            for slot in range(len(rows)):
                cache.trim(slot, args.context)
            return seconds

        times = interleaved_timings(forward_s, range(len(shapes)), args.repeats, warmup=True)
        ms = {text: 1e3 * statistics.median(t) for text, t in zip(shapes, times)}
        prefill_tok_s = None
        if args.prefill:
            runs = []
            for _ in range(3):
                cache.reset(0)
                start = time.perf_counter()
                for at in range(0, args.prefill, PREFILL_CHUNK):
                    n = min(PREFILL_CHUNK, args.prefill - at)
                    model.forward_rows(torch.randint(0, vocab, (n,), generator=g), cache, (0,), (n,),
                                       logits=LogitRows.NONE)
                runs.append(time.perf_counter() - start)
            prefill_tok_s = args.prefill / min(runs)
    first = next(iter(ms.values()))
    print(f"{args.model}, {cpu_model()}, {args.threads} threads, context {args.context}")
    print(f"{'shape':>12} {'ms':>8} {'of the first':>13}")
    for text, value in ms.items():
        print(f"{text:>12} {value:8.3f} {value / first:13.3f}")
    if prefill_tok_s is not None:
        print(f"prefill {args.prefill} tokens (chunks of {PREFILL_CHUNK}): {prefill_tok_s:.0f} tok/s")
    print(json.dumps({"model": args.model, "cpu": cpu_model(), "threads": args.threads, "context": args.context,
                      "forward_ms": ms, "prefill_tok_s": prefill_tok_s}))


if __name__ == "__main__":
    main()
