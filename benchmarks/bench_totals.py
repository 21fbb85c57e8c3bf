"""Speedups of `specdecode bench` runs as totals: each method's generated tokens over its seconds, summed over the
prompts (overall and per category), against plain decoding's over the same prompts, and the geometric mean of the
per-prompt ratios. The report's own figure is the median of per-prompt ratios, which moves with a few prompts'
timing; totals weigh every prompt by its time. With ``--against M``, also M's total over the best other method's in
each column (methods named M's drafter left out, and plain): issue 51's per-suite check of ``auto``. Given several
runs of the same methods and prompts (rounds, each a fresh process: a learning drafter starts cold in each), every
figure is the median over rounds of that round's own ratio (paired rounds), and the best other method is the one
M is the furthest behind by that median. Reads results.json files; prints a table, then one JSON line. It does not
run anything.

    python benchmarks/bench_totals.py docs/benchmarks/i51-suites-zen5/qwen-suites/results.json
    python benchmarks/bench_totals.py docs/benchmarks/zen4-dec07/smol-l8/results.json --against auto:adaptive
    python benchmarks/bench_totals.py run1/results.json run2/results.json run3/results.json --against auto:adaptive
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict

PLAIN = "none"


def totals(samples: list[dict]) -> dict[str, dict[str, float]]:
    """Per method: "overall", each category (total tokens/s over plain's) and "geomean" (of per-prompt ratios)."""
    sums: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    speed: dict[str, dict[str, float]] = defaultdict(dict)
    for s in samples:
        for key in ("overall", s["category"]):
            cell = sums[s["method"]][key]
            cell[0] += s["tokens"]
            cell[1] += s["seconds"]
        speed[s["method"]][s["prompt_id"]] = s["tokens_per_s"]  # (one repeat: the run's median per prompt is this)
    if PLAIN not in sums:
        raise SystemExit("the run has no plain decoding ('none') to compare with")
    plain = {key: tokens / seconds for key, (tokens, seconds) in sums[PLAIN].items()}
    out = {}
    for method, cells in sums.items():
        row = {key: tokens / seconds / plain[key] for key, (tokens, seconds) in cells.items()}
        logs = [math.log(v / speed[PLAIN][p]) for p, v in speed[method].items()]
        row["geomean"] = math.exp(sum(logs) / len(logs))
        out[method] = row
    return out


def check_rounds(runs: list[dict], paths: list[str]) -> None:
    """Refuses runs that are not rounds of one command: other methods or other prompts than the first run's."""
    def shape(run: dict) -> tuple[set[str], set[str]]:
        return {s["method"] for s in run["samples"]}, {s["prompt_id"] for s in run["samples"]}
    first = shape(runs[0])
    for run, path in zip(runs[1:], paths[1:]):
        methods, prompts = shape(run)
        if methods != first[0]:
            raise SystemExit(f"{path}: its methods differ from {paths[0]}'s (pair only runs of one command)")
        if prompts != first[1]:
            raise SystemExit(f"{path}: its prompts differ from {paths[0]}'s (pair only runs of one command)")


def medians(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per method and column, the median over rounds of the round's figure."""
    return {m: {k: statistics.median(r[m][k] for r in rounds) for k in row} for m, row in rounds[0].items()}


def against(rounds: list[dict[str, dict[str, float]]], method: str) -> dict[str, tuple[float, str]]:
    """Per column: ``method``'s total over the best single method's (not plain, not ``method``'s own drafter) as the
    median over rounds of each round's ratio, and that method's name (the one whose median ratio is the lowest)."""
    if method not in rounds[0]:
        raise SystemExit(f"--against {method}: the run has no such method (it has {', '.join(rounds[0])})")
    drafter = method.split(":")[0]
    others = [m for m in rounds[0] if m != PLAIN and m.split(":")[0] != drafter]
    if not others:
        raise SystemExit(f"--against {method}: the run has no other drafter to compare with")
    out = {}
    for key in rounds[0][method]:
        paired = {m: statistics.median(r[method][key] / r[m][key] for r in rounds) for m in others}
        best = min(others, key=paired.__getitem__)
        out[key] = (paired[best], best)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="bench runs' results.json (several: rounds of the same methods, prompts)")
    p.add_argument("--against", metavar="METHOD", help="also METHOD over the best other method, per column")
    args = p.parse_args()
    runs = []
    for path in args.results:
        with open(path) as f:
            runs.append(json.load(f))
        if runs[-1]["config"].get("repeats", 1) != 1:
            raise SystemExit(f"{path}: totals need one-repeat runs (a repeat's samples would count twice)")
    check_rounds(runs, args.results)
    rounds = [totals(run["samples"]) for run in runs]
    rows = medians(rounds)
    keys = ["overall", "geomean", *sorted(k for k in rows[PLAIN] if k not in ("overall", "geomean"))]
    if len(rounds) > 1:
        print(f"medians over {len(rounds)} rounds of each round's ratio")
    print(f"{'method':24s}" + "".join(f"{k[:9]:>10s}" for k in keys))
    for method, row in rows.items():
        print(f"{method:24s}" + "".join(f"{row[k]:10.3f}" for k in keys))
    line = {"model": runs[0]["config"]["model"], "cpu": runs[0]["environment"].get("cpu_model"),
            "rounds": len(rounds), "rows": rows}
    if args.against:
        ratios = against(rounds, args.against)
        categories = keys[2:]  # (after overall and geomean)
        met = sum(ratios[k][0] >= 0.98 for k in categories)
        print(f"\n{args.against} over the best other method (at least 0.98: {met} of {len(categories)} categories)")
        for key in keys:
            print(f"  {key:16s} {ratios[key][0]:6.3f}  ({ratios[key][1]})")
        line["against"] = {"method": args.against,
                           "ratios": {k: {"ratio": r, "best": b} for k, (r, b) in ratios.items()}}
    print(json.dumps(line))


if __name__ == "__main__":
    main()
