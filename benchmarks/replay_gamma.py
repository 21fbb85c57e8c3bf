"""Gamma controllers compared without timing noise: greedy decoding replayed from recorded drafts.

Greedy speculation emits the target's own greedy output whatever the controller does, so a run can be
replayed: ``record`` stores, per prompt, the target's output and, at every output position, the
drafter's ``gamma_max``-token proposal with its signals, plus the measured verification curve v(k) and
draft cost (relative to a plain step). ``replay`` then runs any controller over those records, timing
each step as ``k * draft_cost + v(k)`` plain steps, and prints the median speedup over plain decoding
per category (a table, then one JSON line). Wall-clock figures come from ``specdecode bench``; this is
for telling controllers apart where the bench's run-to-run spread (~5-20% per prompt on a shared CPU)
hides the differences.

What it leaves out: costs that depend on history (a draft model catching up after plain steps), the
growth of v(k) with context, and the bookkeeping of each step. It records ``ngram``, ``suffix``, ``auto``
and ``draft`` (``layerskip`` shares the target's cache, which the recording does not drive); a learning drafter
learns as it goes, one output token at a time, not from the drafts a controller would have had verified.

    .venv/bin/python benchmarks/replay_gamma.py record --drafter ngram --limit 12 --out smol-ngram.json
    .venv/bin/python benchmarks/replay_gamma.py record --model qwen2.5-coder-1.5b-instruct \\
        --draft-model qwen2.5-coder-0.5b-instruct --drafter draft --max-new-tokens 64 --limit 2 --out qwen.json
    .venv/bin/python benchmarks/replay_gamma.py replay qwen.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Sequence

import torch

from specdecode.control import GAMMA_POLICIES, ControllerFactory, StepContext, StepRecord, controller_factory
from specdecode.drafters import Drafter, DrafterInputs, registry
from specdecode.engine import Engine
from specdecode.sampling import SamplingParams

FORMAT = "specdecode-replay"


def record(engine: Engine, drafter: Drafter, prompts: Sequence[tuple[str, str, list[int]]], max_new_tokens: int,
           gamma_max: int = 8, repeats: int = 5) -> dict[str, Any]:
    """Reference outputs of ``engine`` (plain decoding) and ``drafter``'s proposal at every output position.

    Args:
        engine: a plain-decoding engine on the target.
        drafter: the drafter whose proposals are recorded (its signals too).
        prompts: (id, category, token ids) triples.
        max_new_tokens: output budget per prompt.
        gamma_max: tokens proposed per position (the longest draft a replay can ask for).
        repeats: timings per point of the verification curve (median).
    """
    greedy, rows, draft_s, drafted = SamplingParams(), [], [], 0
    for pid, category, ids in prompts:
        output = engine.generate(ids, max_new_tokens=max_new_tokens).token_ids
        drafter.reset(engine.cache, ids, engine.memory)
        seq, proposals = list(ids), []
        for token in output:
            start = time.perf_counter()
            draft = drafter.propose(seq, gamma_max, greedy, None, lambda i, s: False)
            draft_s.append(time.perf_counter() - start)
            drafted += len(draft.tokens)
            proposals.append({"tokens": draft.tokens, "signals": [list(s) for s in draft.signals]})
            seq.append(token)
            drafter.commit(seq)
        rows.append({"id": pid, "category": category, "prompt_len": len(ids), "output": output, "proposals": proposals})
    # Timed at the last prompt's context, after its requests: the median of repeats per k.
    with engine.verify_timer(ids) as seconds:
        verify = [statistics.median(seconds(k) for _ in range(repeats)) for k in range(gamma_max + 1)]
    return {"format": FORMAT, "drafter": drafter.name, "signal_names": list(drafter.signal_names),
            "gamma_max": gamma_max, "v": [t / verify[0] for t in verify],
            "draft_cost": sum(draft_s) / max(drafted, 1) / verify[0], "prompts": rows}


def replay_prompt(row: dict[str, Any], make: ControllerFactory, v: Sequence[float], draft_cost: float,
                  max_context: int = 1 << 20) -> tuple[float, int]:
    """Plain steps' worth of time and the number of steps a controller takes to emit ``row``'s output."""
    controller, out, done, time_steps, steps = make(), row["output"], 0, 0.0, 0
    gamma_max = len(v) - 1
    while done < len(out):
        remaining = len(out) - done
        ctx = StepContext(remaining=remaining, context_len=row["prompt_len"] + done, max_context=max_context)
        k = min(controller.next_gamma(ctx), remaining - 1, gamma_max)
        proposal = row["proposals"][done]
        tokens, signals = proposal["tokens"][:k], [tuple(s) for s in proposal["signals"][:k]]
        if controller.early_stop and tokens:
            end = next((i + 1 for i, s in enumerate(signals) if controller.stop(i, s)), len(tokens))
            tokens, signals = tokens[:end], signals[:end]
        accepted = 0
        while accepted < len(tokens) and tokens[accepted] == out[done + accepted]:
            accepted += 1
        d, t = draft_cost * len(tokens), v[len(tokens)]
        controller.update(StepRecord(ctx=ctx, requested=k, drafted=len(tokens), accepted=accepted, draft_s=d,
                                     verify_s=t, signals=signals))
        time_steps += d + t
        steps += 1
        done += accepted + 1
    return time_steps, steps


def replay(data: dict[str, Any], policies: Sequence[int | str], draft_cost: float | None = None,
           controller_file: str | None = None) -> dict[str, dict[str, float]]:
    """Median speedup over plain decoding, overall and per category, of each policy (prompts in file order;
    the controllers' shared estimates carry from one prompt to the next, as in one engine)."""
    if data.get("format") != FORMAT:
        raise ValueError(f"not a replay record (format {data.get('format')!r}, expected {FORMAT!r})")
    v, cost = data["v"], data["draft_cost"] if draft_cost is None else draft_cost
    cats = list(dict.fromkeys(r["category"] for r in data["prompts"]))
    results = {}
    for policy in policies:
        make = controller_factory(policy, data["gamma_max"], data["drafter"], data["signal_names"], controller_file)
        if make.shared is not None:  # as BatchEngine.warmup does, in units of one plain step
            make.shared.costs.seed(v)
        speed = {r["id"]: len(r["output"]) / replay_prompt(r, make, v, cost)[0] for r in data["prompts"]}
        results[str(policy)] = {"overall": statistics.median(speed.values()), **{
            c: statistics.median(speed[r["id"]] for r in data["prompts"] if r["category"] == c) for c in cats}}
    return results


def _record_command(args: argparse.Namespace) -> None:
    from specdecode.bench.prompts import default_prompts, packaged_prompts, select
    from specdecode.models.build import load_model
    from specdecode.prompts import render

    torch.set_num_threads(args.threads)
    target = load_model(args.model, progress=lambda m: print(m, file=sys.stderr))
    draft = load_model(args.draft_model) if args.draft_model else None
    inputs = DrafterInputs(target=target.model, draft_model=draft.model if draft else None)
    drafter = registry.build(args.drafter, inputs)
    engine = Engine(target.model, target.tokenizer)
    engine.warmup()
    suites = args.categories.split(",") if args.categories else None
    chosen = select(packaged_prompts(suites) if suites else default_prompts(), limit=args.limit)
    prompts = [(p.id, p.category, render(p, target.tokenizer)) for p in chosen]
    data = record(engine, drafter, prompts, args.max_new_tokens, args.gamma_max)
    data.update(model=args.model, draft_model=args.draft_model)
    with open(args.out, "w") as f:
        json.dump(data, f)
    print(f"recorded {len(prompts)} prompts: v = {[round(x, 3) for x in data['v']]}, "
          f"draft cost {data['draft_cost']:.3f} of a step -> {args.out}", file=sys.stderr)


def _replay_command(args: argparse.Namespace) -> None:
    with open(args.file) as f:
        data = json.load(f)
    policies = [int(g) if g.isdigit() else g for g in args.policies.split(",")]
    results = replay(data, policies, args.draft_cost, args.controller_file)
    cats = [c for c in next(iter(results.values())) if c != "overall"]
    print(f"{'policy':<12}" + "".join(f"{c[:13]:>14}" for c in cats) + f"{'overall':>10}")
    for name, row in results.items():
        print(f"{name:<12}" + "".join(f"{row[c]:>14.3f}" for c in cats) + f"{row['overall']:>10.3f}")
    print(json.dumps({"file": args.file, "draft_cost": args.draft_cost or data["draft_cost"], "results": results}))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="record reference outputs and per-position proposals")
    r.add_argument("--model", default="smollm2-135m-instruct")
    r.add_argument("--draft-model", default=None)
    r.add_argument("--drafter", choices=("ngram", "suffix", "auto", "draft"), default="ngram")
    r.add_argument("--max-new-tokens", type=int, default=96)
    r.add_argument("--limit", type=int, default=None, help="prompts per category (default: all)")
    r.add_argument("--categories", default=None, help="comma list of the bench's suites (default: the chat ones)")
    r.add_argument("--gamma-max", type=int, default=8)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--out", required=True)
    p = sub.add_parser("replay", help="replay controllers over a record")
    p.add_argument("file")
    p.add_argument("--policies", default="1,2,3,4,5,6,7,8," + ",".join(GAMMA_POLICIES))
    p.add_argument("--draft-cost", type=float, default=None, help="draft cost per token in plain steps (default: recorded)")
    p.add_argument("--controller-file", default=None)
    args = parser.parse_args(argv)
    try:
        (_record_command if args.command == "record" else _replay_command)(args)
    except (OSError, ValueError) as exc:  # a missing or foreign file, an unknown policy or drafter pair
        parser.exit(2, f"replay_gamma: error: {exc}\n")


if __name__ == "__main__":
    main()
