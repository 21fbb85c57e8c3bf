"""Whether the quantized kernels should prefetch a projection's next tile into L1 or L2 on this CPU.

Each build picks by the L1 data cache's size (``linear_quant.h``: L1 where it holds 48 KB or more); this times
forwards of one model over ``--rows`` rows (verification of k = rows - 1 drafted tokens after a code prompt) with
either level, the two levels interleaved per round, and prints each size's median milliseconds and the ratio L2 / L1,
then one JSON line. The outputs are bitwise the same either way (only the prefetch hint differs).

    .venv/bin/python benchmarks/prefetch_level.py --model qwen2.5-coder-1.5b-instruct --rows 1,5,9,17 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from specdecode.engine import Engine
from specdecode.models import native
from specdecode.models.build import load_model
from specdecode.models.native import cpu_model
from specdecode.timing import interleaved_timings

from cost_curve import PROMPT  # the context cost_curve.py times at (run as a script: benchmarks/ is on the path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--weights", default="auto", help="our weight format (--weights of generate)")
    p.add_argument("--rows", default="1,5,9", help="comma list of rows per forward")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, weights=args.weights)
    ids = model.tokenizer.encode(PROMPT)
    rows = [int(r) for r in args.rows.split(",")]
    cases = [(level, r) for r in rows for level in (0, 1)]
    engine = Engine(model.model, model.tokenizer)
    with engine.verify_timer(ids) as verify_seconds:
        def run(case: int) -> float:
            level, r = cases[case]
            native.set_prefetch_level(level)
            return verify_seconds(r - 1)

        times = interleaved_timings(run, range(len(cases)), args.repeats, warmup=True)
    ms = {cases[i]: statistics.median(t) * 1e3 for i, t in enumerate(times)}
    print(f"{args.model} ({model.model.weight_format}), {cpu_model()}, {args.threads} threads, context {len(ids)}")
    print(f"{'rows':>5} {'L1 ms':>8} {'L2 ms':>8} {'L2/L1':>6}")
    for r in rows:
        print(f"{r:>5} {ms[(0, r)]:>8.2f} {ms[(1, r)]:>8.2f} {ms[(1, r)] / ms[(0, r)]:>6.3f}")
    print(json.dumps({"model": args.model, "cpu": cpu_model(), "threads": args.threads, "context": len(ids),
                      "rows": [{"rows": r, "l1_ms": round(ms[(0, r)], 3), "l2_ms": round(ms[(1, r)], 3)}
                               for r in rows]}))


if __name__ == "__main__":
    main()
