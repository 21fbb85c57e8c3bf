"""The ``specdecode bench`` command: its arguments and the glue from parsed arguments to output files.

Kept out of ``cli.py`` so that the CLI stays a thin dispatcher; it only parses, calls the runner and the
report, and prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specdecode.engine import MAX_GAMMA
from specdecode.argtypes import add_kv_arguments, cache_configs, gamma, ngram_sizes, nonnegative_int, positive_int
from specdecode.control import GAMMA_POLICIES
from specdecode.bench.methods import DRAFT_MODEL_FAMILIES, FAMILIES
from specdecode.drafters import TREE_WIDTH, base_kind
from specdecode.models.build import DRAFT_QUANT
from specdecode.models.weights import WEIGHT_FORMATS


def _families(value: str) -> tuple[str, ...]:
    items = tuple(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
    unknown = [v for v in items if v not in FAMILIES]
    if unknown or not items:
        raise argparse.ArgumentTypeError(f"unknown method families {unknown or [value]}; "
                                         f"expected a comma list of {','.join(FAMILIES)}")
    return items


def _gammas(value: str) -> tuple[int | str, ...]:
    out: list[int | str] = []
    for v in (v.strip() for v in value.split(",")):
        if not v:
            continue
        g = gamma(v)
        if isinstance(g, int) and not 1 <= g <= MAX_GAMMA:
            raise argparse.ArgumentTypeError(f"gamma must be in 1..{MAX_GAMMA}, got {g}")
        out.append(g)
    if not out:
        raise argparse.ArgumentTypeError("give at least one gamma")
    if "agreement" not in out:
        out.append("agreement")  # the adaptive controller always runs next to the fixed gammas
    return tuple(dict.fromkeys(out))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench options (``--model``, ``--dtype`` and ``--threads`` come from the CLI's shared set)."""
    p.add_argument("--draft-model", default=None,
                   help="draft model for the 'draft' and 'hf-assisted' methods (same vocabulary as --model)")
    p.add_argument("--methods", type=_families, default=None,
                   help=f"comma list of method families: {','.join(FAMILIES)} (default: all that apply; "
                        "draft and hf-assisted only with --draft-model; 'none' always runs as the reference)")
    p.add_argument("--gammas", type=_gammas, default=_gammas("1,2,4,8"),
                   help=f"draft lengths and controllers ({','.join(GAMMA_POLICIES)}) of every drafting method "
                        "(default 1,2,4,8); 'agreement' always runs too")
    p.add_argument("--gamma-max", type=positive_int, default=8, help="upper bound of the controllers")
    p.add_argument("--controller-file", default=None, metavar="FILE",
                   help="acceptance models for the confidence and adaptive controllers (default: the shipped one)")
    p.add_argument("--record-steps", default=None, metavar="FILE.jsonl",
                   help="write every step of our drafting methods' timed calls (draft signals, verdicts, costs) as "
                        "JSON lines, for `specdecode fit-controller`")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="token budget of every method (default 128)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default; outputs checked token-identical to 'none'); > 0 samples, seeded per prompt")
    p.add_argument("--seed", type=int, default=0, help="base seed; prompt i uses seed + i")
    p.add_argument("--repeats", type=positive_int, default=1, help="timed runs per method and prompt (median)")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help="your own prompts: JSONL lines {id, category, prompt|messages} (default: packaged suites)")
    p.add_argument("--categories", default=None, help="comma list of categories to run (default: all)")
    p.add_argument("--limit", type=positive_int, default=None, help="at most N prompts per category")
    p.add_argument("--skip-layers", default="auto",
                   help="layers layerskip skips, e.g. '4,6,8-12'; 'auto' uses (or runs) the stored calibration")
    p.add_argument("--eagle-head", default=None, metavar="FILE",
                   help="head file of the eagle methods (default: the one shipped for --model, if any)")
    p.add_argument("--medusa-head", default=None, metavar="FILE",
                   help="head file of the medusa methods (default: the one shipped for --model, if any)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="draft vocabulary of the eagle and medusa methods: the N most frequent tokens (0 = all; "
                        "default: as each head was trained)")
    p.add_argument("--ngram", type=ngram_sizes, default=(1, 3),
                   help="min,max n-gram sizes of the ngram drafter; max is also hf-lookup's (default 1,3)")
    p.add_argument("--tree-width", type=positive_int, default=TREE_WIDTH, metavar="W",
                   help=f"children per expanded node of the draft-tree and eagle-tree methods (default {TREE_WIDTH})")
    p.add_argument("--no-chat", dest="chat", action="store_false",
                   help="feed plain 'prompt' entries as raw text (default: wrapped as one user message in the "
                        "model's chat template, when it has one)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON ('-' = stdout, no table)")
    p.add_argument("--report", default=None, metavar="DIR", help="write report.md, results.json and PNG plots into DIR")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")
    p.add_argument("--cost-curve", type=nonnegative_int, default=16, metavar="K",
                   help="also time verifying 0..K drafted tokens, v(k) (default 16; 0 = skip)")
    p.add_argument("--draft-quant", choices=DRAFT_QUANT, default="none",
                   help="int8: our draft model with int8 weight-only projections (peers keep bf16)")
    p.add_argument("--draft-weights", choices=WEIGHT_FORMATS, default="auto",
                   help="our draft model's weight format, as --weights is the target's (default auto)")
    add_kv_arguments(p)


def run_command(args: argparse.Namespace) -> int:
    """Runs the benchmark; exit status 0, or 1 when a lossless method changed a greedy output or one of ours failed."""
    from specdecode.bench.prompts import default_prompts, select
    from specdecode.prompts import load_prompts
    from specdecode.bench.report import build_document, format_table, matplotlib_available, write_report
    from specdecode.bench.runner import BenchConfig, environment, run_bench
    from specdecode.control.model_file import load_controller_file

    if args.report and not matplotlib_available():
        raise ValueError("--report needs matplotlib, which is not installed: pip install 'specdecode[bench]'")
    if any(g in ("confidence", "adaptive") for g in args.gammas):
        load_controller_file(args.controller_file)  # a damaged or mismatched file fails before any model loads
    prompts = load_prompts(args.prompts) if args.prompts else default_prompts()
    categories = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    prompts = select(prompts, categories, args.limit)
    families = args.methods
    if families is None:
        families = tuple(f for f in FAMILIES if args.draft_model or f not in DRAFT_MODEL_FAMILIES)
    cache, draft_cache = cache_configs(args, draft=bool(args.draft_model) or
                                       any(base_kind(m) == "eagle" for m in args.methods or ()))
    config = BenchConfig(model=args.model, draft_model=args.draft_model, families=families, gammas=args.gammas,
                         max_new_tokens=args.max_new_tokens, temperature=args.temperature, repeats=args.repeats,
                         dtype=args.dtype, seed=args.seed, skip_layers=args.skip_layers, ngram_sizes=args.ngram,
                         gamma_max=args.gamma_max, chat=args.chat, cost_curve=args.cost_curve, linear=args.linear,
                         draft_quant=args.draft_quant, controller_file=args.controller_file,
                         record_steps=args.record_steps, cache=cache, draft_cache=draft_cache,
                         heads={"eagle": args.eagle_head, "medusa": args.medusa_head}, draft_vocab=args.draft_vocab,
                         tree_width=args.tree_width, weights=args.weights, draft_weights=args.draft_weights)
    result = run_bench(config, prompts, progress=args.progress)
    echo: dict[str, Any] = {
        "model": args.model, "draft_model": args.draft_model, "methods": list(families),
        "gammas": list(args.gammas), "gamma_max": args.gamma_max, "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature, "seed": args.seed, "repeats": args.repeats, "dtype": args.dtype,
        "prompts_file": args.prompts, "categories": categories, "limit": args.limit, "skip_layers": args.skip_layers,
        "eagle_head": args.eagle_head, "medusa_head": args.medusa_head, "draft_vocab": args.draft_vocab,
        "tree_width": args.tree_width,
        "ngram": list(args.ngram), "chat": args.chat, "threads": getattr(args, "threads", None),
        "cost_curve": args.cost_curve, "linear": args.linear, "draft_quant": args.draft_quant,
        "weights": list(args.weights), "draft_weights": args.draft_weights,
        "controller_file": args.controller_file, "record_steps": args.record_steps,
        "kv_dtype": args.kv_dtype, "draft_kv_dtype": args.draft_kv_dtype, "kv_window": args.kv_window,
        "kv_sinks": args.kv_sinks, "kv_budget": args.kv_budget, "prefix_cache": args.prefix_cache}
    doc = build_document(result, echo, environment())
    text = json.dumps(doc, indent=1)
    if args.json == "-":
        print(text)
    else:
        print(format_table(doc))
        if args.json:
            Path(args.json).write_text(text)
            print(f"wrote {args.json}", file=sys.stderr)
    if args.record_steps:
        print(f"wrote {args.record_steps}", file=sys.stderr)
    if args.report:
        files = write_report(doc, args.report)
        print(f"wrote {', '.join(str(f) for f in files)}", file=sys.stderr)
    ours_failed = [f for f in doc["failed"]
                   if base_kind(f["name"].partition("@")[0].split(":")[0]) in ("none", "ngram", "draft", "layerskip")]
    mismatch = doc["identical_outputs"] is not None and doc["identical_outputs"] != doc["identity_comparisons"]
    return 1 if mismatch or ours_failed else 0
