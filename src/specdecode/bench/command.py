"""The ``specdecode bench`` command: its flags, the :class:`BenchCommand` they make (:func:`bench_command`,
the one place they are read), and the glue from that config to output files.

Kept out of ``cli.py`` so that the CLI stays a thin dispatcher; it only parses, calls the runner and the
report, and prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdecode.argtypes import ngram_sizes, nonnegative_int, positive_int
from specdecode.bench.methods import DRAFT_MODEL_FAMILIES, FAMILIES
from specdecode.bench.runner import BenchConfig
from specdecode.control import GAMMA_POLICIES
from specdecode.control.config import MAX_GAMMA
from specdecode.drafter_setup import PLAIN
from specdecode.drafters import TREE_WIDTH, Needs, registry
from specdecode.flags import add_kv_arguments, add_model_arguments, cache_configs, gamma
from specdecode.models.build import CHEAPEST, DRAFT_QUANT, DRAFT_WEIGHTS


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
    """Every ``bench`` flag, the shared model flags first (no ``--device``: the benchmark runs on the CPU)."""
    add_model_arguments(p, device=False, weights_list=True)
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
    p.add_argument("--categories", default=None,
                   help="comma list of categories to run (default: the 7 standard ones); the packaged suites 'edit' "
                        "(edits with the original as each prompt's prediction) and 'agentic' (request sequences that "
                        "repeat structure, in file order) run only when named here")
    p.add_argument("--limit", type=positive_int, default=None, help="at most N prompts per category")
    p.add_argument("--skip-layers", default="auto",
                   help="layers layerskip skips, e.g. '4,6,8-12'; 'auto' uses (or runs) the stored calibration")
    p.add_argument("--eagle-head", default=None, metavar="FILE",
                   help="head file of the eagle methods (default: the one shipped for --model, if any)")
    p.add_argument("--medusa-head", default=None, metavar="FILE",
                   help="head file of the medusa methods (default: the one shipped for --model, if any)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="draft vocabulary of the eagle, medusa, draft and draft-tree methods: a head's N most "
                        "frequent tokens, a draft model's end-of-sequence and first ids, N in all (0 = all; "
                        "default: as each head was trained, a draft model's all)")
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
    p.add_argument("--draft-weights", choices=DRAFT_WEIGHTS, default=CHEAPEST,
                   help="our draft model's weight format, as --weights is the target's; cheapest (default, as "
                        "generate's) = q4_1 on our kernels, else auto")
    add_kv_arguments(p)


@dataclass(frozen=True)
class BenchCommand:
    """One ``specdecode bench`` run: what runs, on which prompts, and where the results go.

    Args:
        run: the methods, models and settings (``runner.BenchConfig``).
        prompts: a JSONL prompt file; None = the packaged suites.
        categories: the categories to run; None = all.
        limit: at most this many prompts per category; None = all.
        json: write the results as JSON there ("-" = stdout, no table); None = the table only.
        report: write report.md, results.json and PNG plots into this folder; None = none.
        progress: draw a progress bar on stderr.
        threads: torch's intra-op threads as ``--threads`` set them (recorded with the results).
    """

    run: BenchConfig
    prompts: str | None = None
    categories: tuple[str, ...] | None = None
    limit: int | None = None
    json: str | None = None
    report: str | None = None
    progress: bool = True
    threads: int | None = None


def bench_command(args: argparse.Namespace) -> BenchCommand:
    """The run the flags describe; contradictory flags raise ValueError (naming them) before anything loads."""
    families = args.methods
    if families is None:
        families = tuple(f for f in FAMILIES if args.draft_model or f not in DRAFT_MODEL_FAMILIES)
    # A draft cache is asked for with a draft model, or with a method named on the command line that keeps one.
    asked = [f for f in args.methods or () if f in registry.names()]
    cache, draft_cache = cache_configs(args, draft=bool(args.draft_model) or
                                       any(registry.spec(f).owns_cache for f in asked))
    run = BenchConfig(model=args.model, draft_model=args.draft_model, families=families, gammas=args.gammas,
                      max_new_tokens=args.max_new_tokens, temperature=args.temperature, repeats=args.repeats,
                      dtype=args.dtype, seed=args.seed, skip_layers=args.skip_layers, ngram_sizes=args.ngram,
                      gamma_max=args.gamma_max, chat=args.chat, cost_curve=args.cost_curve, linear=args.linear,
                      draft_quant=args.draft_quant, controller_file=args.controller_file,
                      record_steps=args.record_steps, cache=cache, draft_cache=draft_cache,
                      heads={"eagle": args.eagle_head, "medusa": args.medusa_head}, draft_vocab=args.draft_vocab,
                      tree_width=args.tree_width, weights=args.weights, draft_weights=args.draft_weights)
    categories = tuple(c.strip() for c in args.categories.split(",") if c.strip()) if args.categories else None
    return BenchCommand(run, args.prompts, categories, args.limit, args.json, args.report, args.progress,
                        args.threads)


def _echo(command: BenchCommand) -> dict[str, Any]:
    """The settings as the results' ``config`` records them (flag names, flag values)."""
    run = command.run
    return {
        "model": run.model, "draft_model": run.draft_model, "methods": list(run.families),
        "gammas": list(run.gammas), "gamma_max": run.gamma_max, "max_new_tokens": run.max_new_tokens,
        "temperature": run.temperature, "seed": run.seed, "repeats": run.repeats, "dtype": run.dtype,
        "prompts_file": command.prompts, "categories": None if command.categories is None else list(command.categories),
        "limit": command.limit, "skip_layers": run.skip_layers, "eagle_head": run.heads.get("eagle"),
        "medusa_head": run.heads.get("medusa"), "draft_vocab": run.draft_vocab, "tree_width": run.tree_width,
        "ngram": list(run.ngram_sizes), "chat": run.chat, "threads": command.threads,
        "cost_curve": run.cost_curve, "linear": run.linear, "draft_quant": run.draft_quant,
        "weights": list(run.weights), "draft_weights": run.draft_weights,
        "controller_file": run.controller_file, "record_steps": run.record_steps,
        "kv_dtype": run.cache.kv_dtype, "draft_kv_dtype": run.draft_cache.kv_dtype, "kv_window": run.cache.window,
        "kv_sinks": run.cache.sinks, "kv_budget": run.cache.budget, "prefix_cache": run.cache.prefix_cache}


def run_command(command: BenchCommand) -> int:
    """Runs the benchmark; exit status 0, or 1 when a lossless method changed a greedy output or one of ours failed."""
    from specdecode.bench.prompts import default_prompts, packaged_prompts, select
    from specdecode.bench.report import build_document, format_table, matplotlib_available, write_report
    from specdecode.bench.runner import environment, run_bench
    from specdecode.control.model_file import load_controller_file
    from specdecode.prompts import load_prompts

    run = command.run
    if command.report and not matplotlib_available():
        raise ValueError("--report needs matplotlib, which is not installed: pip install 'specdecode[bench]'")
    if any(g in ("confidence", "adaptive") for g in run.gammas):
        load_controller_file(run.controller_file)  # a damaged or mismatched file fails before any model loads
    if command.prompts:
        prompts = load_prompts(command.prompts)
    else:  # named categories are packaged suites (the extra ones included); unknown ones are refused, listed
        prompts = packaged_prompts(command.categories) if command.categories else default_prompts()
    prompts = select(prompts, command.categories, command.limit)
    result = run_bench(run, prompts, progress=command.progress)
    doc = build_document(result, _echo(command), environment())
    text = json.dumps(doc, indent=1)
    if command.json == "-":
        print(text)
    else:
        print(format_table(doc))
        if command.json:
            Path(command.json).write_text(text)
            print(f"wrote {command.json}", file=sys.stderr)
    if run.record_steps:
        print(f"wrote {run.record_steps}", file=sys.stderr)
    if command.report:
        files = write_report(doc, command.report)
        print(f"wrote {', '.join(str(f) for f in files)}", file=sys.stderr)
    ours_failed = [f for f in doc["failed"] if _gates(f["name"].partition("@")[0].split(":")[0])]
    mismatch = doc["identical_outputs"] is not None and doc["identical_outputs"] != doc["identity_comparisons"]
    return 1 if mismatch or ours_failed else 0


def _gates(family: str) -> bool:
    """Whether a failure of ``family`` fails the run: ours, plain decoding included, except trained heads (a head
    file may be missing)."""
    return family == PLAIN or family in registry.names() and not registry.spec(family).needs & Needs.HEAD
