"""Aggregation and output of a benchmark run: figures, the JSON document, the stdout table, Markdown and PNGs.

Aggregation rules (per method, per category and overall):
- tokens/s of a prompt = median over its repeats of generated tokens / wall seconds; a group's
  tokens/s = median over its prompts (min and max are reported too).
- speedup vs a baseline = per prompt, the method's tokens/s / the baseline's tokens/s; then median,
  min and max over the prompts.
- tau, acceptance rate, acceptance by draft position, mean gamma and the controller's share of the
  time (control seconds / wall seconds) pool the engine's counters over every call of the group
  (ratios of sums); predicted speedup = median over calls of RequestStats'
  prediction (compare with the measured speedup vs ``none``).
- identity (greedy only): each call of our speculative methods is compared with ``none``'s output on
  the same prompt and repeat (in a run of several weight formats, with its own format's ``none@format``,
  which is also its ``speedup_vs_none`` baseline; peers are compared with the first format's).
- KV memory (ours only): ``kv_bytes`` = the most any call's target cache held at its end, ``kv_bytes_per_token``
  and ``draft_kv_bytes_per_token`` = median over calls of bytes held / tokens held.
Every float in the JSON is rounded to ROUND decimals, and the Markdown report prints those very values.
This module runs no model.
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any, Iterable, Sequence

from specdecode.bench.methods import OUR_FAMILIES, plain_of
from specdecode.drafters import registry

SCHEMA_VERSION = 1
ROUND = 4
BASELINES = ("hf", "none", "llamacpp")


def _r(x: float | None) -> float | None:
    return None if x is None else round(float(x), ROUND)


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def prompt_tokens_per_s(samples: Iterable[Any]) -> dict[str, dict[str, float]]:
    """method -> prompt id -> median over repeats of tokens/s."""
    runs: dict[str, dict[str, list[float]]] = {}
    for s in samples:
        tps = s.tokens / s.seconds if s.seconds > 0 else 0.0
        runs.setdefault(s.method, {}).setdefault(s.prompt_id, []).append(tps)
    return {m: {p: statistics.median(v) for p, v in by_prompt.items()} for m, by_prompt in runs.items()}


def _identity(samples: Sequence[Any], reference: dict[tuple[str, int], list[int]]) -> tuple[int, int]:
    """(identical, compared) for samples that have a ``none`` output on the same prompt and repeat."""
    identical = compared = 0
    for s in samples:
        ref = reference.get((s.prompt_id, s.repeat))
        if ref is not None:
            compared += 1
            identical += list(s.token_ids) == ref
    return identical, compared


def empty_figures() -> dict[str, Any]:
    keys = ["prompts", "samples", "tokens", "seconds", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max"]
    for b in BASELINES:
        keys += [f"speedup_vs_{b}", f"speedup_vs_{b}_min", f"speedup_vs_{b}_max"]
    keys += ["mean_accepted_length", "acceptance_rate", "acceptance_by_position", "accepted_length_by_budget",
             "tree_steps", "mean_gamma", "predicted_speedup",
             "draft_ms_per_token", "draft_cost", "control_share", "identical_to_none", "compared_to_none", "kv_bytes", "kv_bytes_per_token",
             "draft_kv_bytes_per_token", "valid_outputs", "checked_outputs", "forced_acceptance", "mask_ms_per_step",
             "mask_share"]
    out: dict[str, Any] = {k: None for k in keys}
    out.update(prompts=0, samples=0, tokens=0, seconds=0.0)
    return out


def figures(samples: Sequence[Any], tps: dict[str, float], baselines: dict[str, dict[str, float] | None],
            prompt_ids: Sequence[str], reference: dict[tuple[str, int], list[int]] | None = None) -> dict[str, Any]:
    """The figures of one method over one group of prompts.

    Args:
        samples: the method's calls on the group's prompts.
        tps: the method's per-prompt tokens/s (see :func:`prompt_tokens_per_s`).
        baselines: baseline name ("hf", "none", "llamacpp") -> its per-prompt tokens/s, or None when it did not run.
        prompt_ids: the group's prompts.
        reference: (prompt id, repeat) -> ``none``'s tokens, for the identity count; None to skip it.
    """
    out = empty_figures()
    ids = [p for p in prompt_ids if p in tps]
    values = [tps[p] for p in ids]
    out.update(prompts=len(ids), samples=len(samples), tokens=sum(s.tokens for s in samples),
               seconds=_r(sum(s.seconds for s in samples)))
    if values:
        out.update(tokens_per_s=_r(_median(values)), tokens_per_s_min=_r(min(values)), tokens_per_s_max=_r(max(values)))
    for name, base in baselines.items():
        if not base:
            continue
        ratios = [tps[p] / base[p] for p in ids if p in base and base[p] > 0]
        if ratios:
            out.update({f"speedup_vs_{name}": _r(_median(ratios)), f"speedup_vs_{name}_min": _r(min(ratios)),
                        f"speedup_vs_{name}_max": _r(max(ratios))})
    stats = [s.stats for s in samples if s.stats]
    if stats:
        out.update(_draft_figures(stats))
    checked = [s.valid for s in samples if getattr(s, "valid", None) is not None]
    if checked:
        out.update(valid_outputs=sum(checked), checked_outputs=len(checked))
    if reference is not None:
        out["identical_to_none"], out["compared_to_none"] = _identity(samples, reference)
    return out


def _draft_figures(stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Drafting's figures over requests' stats (``RequestStats.to_dict``): acceptance, by position and by draft size,
    drafting's and control's costs, KV bytes and, under a grammar, the masks' cost and forced tokens' acceptance."""
    forwards = sum(st["target_forwards"] for st in stats)
    generated = sum(st["tokens_generated"] for st in stats)
    drafted = sum(st["drafted_tokens"] for st in stats)
    accepted = sum(st["accepted_tokens"] for st in stats)
    width = max((len(st["drafted_by_position"]) for st in stats), default=0)
    d_pos, a_pos = [0] * width, [0] * width
    for st in stats:
        for i, (d, a) in enumerate(zip(st["drafted_by_position"], st["accepted_by_position"])):
            d_pos[i] += d
            a_pos[i] += a
    # Per draft size (tokens or tree nodes): steps and accepted tokens, then tokens per step.
    sizes = max((len(st.get("steps_by_budget", ())) for st in stats), default=0)
    b_steps, b_acc = [0] * sizes, [0] * sizes
    for st in stats:
        for i, (n, a) in enumerate(zip(st.get("steps_by_budget", ()), st.get("accepted_by_budget", ()))):
            b_steps[i] += n
            b_acc[i] += a
    predicted = [st["predicted_speedup"] for st in stats if st.get("predicted_speedup") is not None]
    wall = sum(st["wall_s"] for st in stats)
    # Drafting time per drafted token (a head catching up on verified rows included), and as a share
    # of a plain decode step (c in the speedup formula).
    per_token = sum(st.get("draft_s", 0.0) for st in stats) / drafted if drafted else None
    step = _median([st["decode_step_s"] for st in stats if st.get("decode_step_s")])
    out = dict(mean_accepted_length=_r(generated / forwards) if forwards else None,
               acceptance_rate=_r(accepted / drafted) if drafted else None,
               acceptance_by_position=[_r(a / d) for a, d in zip(a_pos, d_pos) if d],
               accepted_length_by_budget=[_r((a + n) / n) if n else None for a, n in zip(b_acc, b_steps)],
               tree_steps=sum(st.get("tree_steps", 0) for st in stats),
               mean_gamma=_r(drafted / forwards) if forwards else None,
               predicted_speedup=_r(_median(predicted)),
               draft_ms_per_token=_r(per_token * 1000) if per_token is not None else None,
               draft_cost=_r(per_token / step) if per_token is not None and step else None,
               control_share=_r(sum(st["control_s"] for st in stats) / wall) if wall > 0 else None,
               kv_bytes=max(st["kv_bytes"] for st in stats),
               kv_bytes_per_token=_r(_median([st["kv_bytes_per_token"] for st in stats])),
               draft_kv_bytes_per_token=_r(_median([st["draft_kv_bytes_per_token"] for st in stats])))
    forced = sum(st.get("forced_drafted", 0) for st in stats)
    mask_s = sum(st.get("grammar_s", 0.0) for st in stats)
    if mask_s:  # decoded under a grammar: the masks' cost, per step and of a plain step
        per_step = mask_s / forwards if forwards else None
        out.update(mask_ms_per_step=_r(per_step * 1000) if per_step else None,
                   mask_share=_r(per_step / step) if per_step and step else None,
                   forced_acceptance=_r(sum(st.get("forced_accepted", 0) for st in stats) / forced)
                   if forced else None)
    return out


def aggregate(samples: Sequence[Any], method_names: Sequence[str], categories: Sequence[str],
              prompts_by_category: dict[str, list[str]], identity: bool) -> dict[str, dict[str, Any]]:
    """method name -> {"overall": figures, "by_category": {category: figures}}.

    Args:
        samples: every timed call (objects with method, prompt_id, category, repeat, tokens, seconds,
            stats, token_ids).
        method_names: the methods, in display order.
        categories: category display order.
        prompts_by_category: category -> prompt ids, in order.
        identity: count outputs identical to ``none`` (greedy runs).
    """
    tps = prompt_tokens_per_s(samples)
    plains = [n for n in method_names if n.partition("@")[0] == "none"]
    outputs: dict[str, dict[tuple[str, int], list[int]]] = {}
    for s in samples:
        if s.method in plains:
            outputs.setdefault(s.method, {})[(s.prompt_id, s.repeat)] = list(s.token_ids)
    all_ids = [p for c in categories for p in prompts_by_category.get(c, [])]
    out = {}
    for name in method_names:
        mine = [s for s in samples if s.method == name]
        ours = name.partition("@")[0].partition(":")[0] in OUR_FAMILIES
        plain = plain_of(name) if ours else (plains[0] if plains else "none")
        # llama.cpp's plain decoding: its own server where it ran (C++ per token), else llama-cpp-python's
        baselines = {"hf": tps.get("hf"), "none": tps.get(plain),
                     "llamacpp": tps.get("llamacpp-server") or tps.get("llamacpp")}
        ref = outputs.get(plain) if identity and name != plain else None
        overall = figures(mine, tps.get(name, {}), baselines, all_ids, ref)
        by_category = {}
        for c in categories:
            ids = set(prompts_by_category.get(c, []))
            by_category[c] = figures([s for s in mine if s.prompt_id in ids], tps.get(name, {}), baselines,
                                     prompts_by_category.get(c, []), ref)
        out[name] = {"overall": overall, "by_category": by_category}
    return out


def gamma_comparison(methods: Sequence[dict[str, Any]], tps: dict[str, dict[str, float]],
                     prompts_by_category: dict[str, list[str]]) -> list[dict[str, Any]]:
    """Each gamma controller against fixed gammas, for every drafting family run with both.

    A controller is compared with the best single fixed gamma over the suite (highest median speedup vs
    ``none``) and, per category, with that category's best one, as the median over prompts of the
    paired ratio (its tokens/s over the fixed gamma's on the same prompt): two medians vs ``none``
    each carry ``none``'s per-prompt spread, the paired ratio does not.

    A category's best fixed gamma, picked on the prompts it is then compared on, is the best of several
    noisy medians and reads high (the winner's curse). ``by_category_held_out`` compares on each prompt
    against the fixed gamma that is best on the category's other prompts (leave one out): what choosing
    a gamma per category from measurements would give on a new prompt.

    Args:
        methods: the document's method entries (name, family, gamma, overall and by_category figures).
        tps: method -> prompt id -> tokens/s (see :func:`prompt_tokens_per_s`).
        prompts_by_category: category -> prompt ids.
    """

    def paired(a: str, b: str, ids: Sequence[str]) -> float | None:
        return _r(_median([tps[a][p] / tps[b][p] for p in ids if p in tps.get(a, {}) and tps.get(b, {}).get(p)]))

    def vs_none(entry: dict[str, Any], category: str | None = None) -> float:
        f = entry["overall"] if category is None else entry["by_category"][category]
        return f["speedup_vs_none"] if f["speedup_vs_none"] is not None else float("-inf")

    def held_out(a: str, fixed: Sequence[str], ids: Sequence[str]) -> float | None:
        none = tps.get(plain_of(a), {})
        ids = [p for p in ids if none.get(p) and p in tps.get(a, {}) and all(tps.get(f, {}).get(p) for f in fixed)]
        if len(ids) < 2:
            return None
        ratios = []
        for p in ids:
            others = [q for q in ids if q != p]
            pick = max(fixed, key=lambda f: _median([tps[f][q] / none[q] for q in others]))
            ratios.append(tps[a][p] / tps[pick][p])
        return _r(_median(ratios))

    out = []
    all_ids = [p for ids in prompts_by_category.values() for p in ids]
    for family, weights in dict.fromkeys((e["family"], e["name"].partition("@")[2]) for e in methods):
        ok = [e for e in methods if e["family"] == family and e["name"].partition("@")[2] == weights
              and e["status"] == "ok" and e["overall"]["samples"]]
        fixed = [e for e in ok if isinstance(e["gamma"], int) and e["gamma"] > 0]
        controllers = [e for e in ok if isinstance(e["gamma"], str)]
        if len(fixed) < 2 or not controllers or not any(vs_none(e) > float("-inf") for e in fixed):
            continue
        best = max(fixed, key=vs_none)
        best_by_category = {c: max(fixed, key=lambda e, c=c: vs_none(e, c))["name"] for c in prompts_by_category}
        out.append({"family": family + (f"@{weights}" if weights else ""), "best_fixed": best["name"], "best_fixed_by_category": best_by_category,
                    "controllers": [{"name": e["name"], "vs_best_fixed": paired(e["name"], best["name"], all_ids),
                                     "by_category": {c: paired(e["name"], best_by_category[c], ids)
                                                     for c, ids in prompts_by_category.items()},
                                     "by_category_held_out": {c: held_out(e["name"], [f["name"] for f in fixed], ids)
                                                              for c, ids in prompts_by_category.items()}}
                                    for e in controllers]})
    return out


# ----------------------------------------------------------------------------------------------
# the JSON document

def build_document(result: Any, config_echo: dict[str, Any], environment: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` document (schema in docs/bench.md) from a ``runner.RunResult``."""
    categories = list(dict.fromkeys(p.category for p in result.prompts))
    by_category: dict[str, list[str]] = {}
    for p in result.prompts:
        by_category.setdefault(p.category, []).append(p.id)
    names = [m.name for m in result.methods]
    greedy = result.config.temperature == 0.0
    has_plain = any(m.family == "none" for m in result.methods)
    figs = aggregate(result.samples, names, categories, by_category, identity=greedy and has_plain)
    methods = _method_entries(result, figs, categories)
    identity_checked = greedy and has_plain
    ours_compared = [e for e in methods if e["kind"] == "ours" and e["family"] != "none" and e["compared_to_none"]]
    identical = sum(e["identical_to_none"] for e in ours_compared) if identity_checked else None
    compared = sum(e["compared_to_none"] for e in ours_compared) if identity_checked else None
    mismatches = [{"method": mm.method, "prompt_id": mm.prompt_id, "repeat": mm.repeat,
                   "first_difference": mm.first_difference} for mm in result.identity_mismatches]
    comparison = gamma_comparison(methods, prompt_tokens_per_s(result.samples), by_category)
    return {
        "schema_version": SCHEMA_VERSION,
        "config": {**config_echo, "model_source": result.model_source, "draft_model_source": result.draft_source,
                   "torch_dtype": result.torch_dtype, "peer_dtype": result.peer_dtype,
                   "linear_kernel": result.linear_kernel},
        "environment": environment,
        "prompts": {"count": len(result.prompts), "categories": categories,
                    "by_category": {c: len(v) for c, v in by_category.items()},
                    "prompt_tokens": result.prompt_tokens},
        "methods": methods,
        "identical_outputs": identical,
        "identity_comparisons": compared,
        "identity_mismatches": mismatches,
        "identity_note": None if identity_checked else (
            "not checked: temperature > 0 (sampled outputs)" if not greedy else "not checked: 'none' did not run"),
        "skipped": [{"name": n, "reason": why} for n, why in result.skipped],
        "failed": [{"name": n, "error": e} for n, e in result.failed.items()],
        "notes": list(result.notes),
        "memory": {"peak_rss_mb": _r(result.peak_rss_mb), "rss_after_load_mb": _r(result.rss_after_load_mb)},
        "timing": {"load_s": _r(result.load_s), "run_s": _r(result.run_s)},
        "cost_curves": [c.to_dict() for c in result.cost_curves],
        "gamma_comparison": comparison,
        "samples": [_sample_entry(s) for s in result.samples],
    }


def _method_entries(result: Any, figs: dict[str, dict[str, Any]], categories: list[str]) -> list[dict[str, Any]]:
    """Each method's entry of the document: its settings and figures; a peer that could not even be built, failed."""
    methods = []
    for m in result.methods:
        f = figs[m.name]
        ours = m.family in OUR_FAMILIES
        entry = {"name": m.name, "family": m.family, "kind": "ours" if ours else "peer", "gamma": m.gamma,
                 "params": m.params, "status": "failed" if m.name in result.failed else "ok",
                 "error": result.failed.get(m.name), "overall": f["overall"], "by_category": f["by_category"],
                 "identical_to_none": f["overall"]["identical_to_none"],
                 "compared_to_none": f["overall"]["compared_to_none"],
                 "rss_mb": _r(result.rss_mb.get(m.name)),
                 "memory_mb": {k: _r(v / 2**20) for k, v in m.memory().items()} if m.memory else None,
                 "kernel": m.kernel, "dtype": m.dtype, "draft_kernel": m.draft_kernel, "draft_dtype": m.draft_dtype,
                 "weights": m.weights, "weight_mb": _r(m.weight_bytes / 2**20) if m.weight_bytes else None,
                 "draft_weights": m.draft_weights, "given_predictions": m.predicts}
        methods.append(entry)
    built = {m.name for m in result.methods}
    for name, error in result.failed.items():  # peers that could not even be built
        if name not in built:
            methods.append({"name": name, "family": name, "kind": "ours" if name in OUR_FAMILIES else "peer",
                            "gamma": None, "params": {}, "status": "failed", "error": error,
                            "overall": empty_figures(), "by_category": {c: empty_figures() for c in categories},
                            "identical_to_none": None, "compared_to_none": None, "rss_mb": None,
                            "memory_mb": None, "kernel": None, "dtype": None, "draft_kernel": None,
                            "draft_dtype": None, "weights": None, "weight_mb": None, "draft_weights": None,
                            "given_predictions": False})
    return methods


def _sample_entry(s: Any) -> dict[str, Any]:
    """One timed call's entry of the document."""
    return {"method": s.method, "prompt_id": s.prompt_id, "category": s.category, "repeat": s.repeat,
            "tokens": s.tokens, "seconds": _r(s.seconds), "tokens_per_s": _r(s.tokens_per_s), "finish": s.finish,
            "valid": s.valid,
            "mean_accepted_length": _r(s.stats["mean_accepted_length"]) if s.stats else None,
            "acceptance_rate": _r(s.stats["acceptance_rate"]) if s.stats and s.stats["drafted_tokens"] else None,
            "predicted_speedup": _r(s.stats["predicted_speedup"]) if s.stats else None,
            "kv_bytes": s.stats["kv_bytes"] if s.stats else None,
            "kv_bytes_per_token": _r(s.stats["kv_bytes_per_token"]) if s.stats else None}


# ----------------------------------------------------------------------------------------------
# text output

def _x(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _range(f: dict[str, Any], key: str) -> str:
    if f.get(key) is None:
        return "-"
    return f"{f[key]:.2f} ({f[key + '_min']:.2f}-{f[key + '_max']:.2f})"


def _identity_cell(entry: dict[str, Any]) -> str:
    if entry["compared_to_none"] is None:
        return "ref" if entry["family"] == "none" else "-"
    mark = "" if entry["identical_to_none"] == entry["compared_to_none"] or entry["kind"] == "peer" else " !!"
    return f"{entry['identical_to_none']}/{entry['compared_to_none']}{mark}"


def dtypes(config: dict[str, Any]) -> str:
    """Our dtype, the peers' if other, and our kernel: "dtype bfloat16 (peers float32), projections on tiled"."""
    ours, peers = config["torch_dtype"], config.get("peer_dtype")  # older documents lack peer_dtype
    return (f"dtype {ours}" + (f" (peers {peers})" if peers and peers != ours else "")
            + (f", projections on {config['linear_kernel']}" if config.get("linear_kernel") else ""))


# weights kept in blocks (models/weights.py)
QUANTIZED_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")


def runs_on(entry: dict[str, Any]) -> str:
    """A method's kernel and dtype, and its draft model's: "onednn bfloat16; draft int8 bfloat16" ("-": unknown)."""
    if not entry.get("kernel"):  # failed to build, or a document older than the per-method record
        return "-"
    def formats(weights: str | None) -> str:  # shown where blocks are quantized (older documents lack it)
        return f" ({weights} weights)" if weights and any(f in weights for f in QUANTIZED_FORMATS) else ""

    out = f"{entry['kernel']} {entry['dtype']}{formats(entry.get('weights'))}"
    if entry.get("draft_kernel"):
        out += f"; draft {entry['draft_kernel']} {entry['draft_dtype']}{formats(entry.get('draft_weights'))}"
    return out


def memory_total(entry: dict[str, Any]) -> float | None:
    """MB a configuration holds (weights + KV caches), or None for peers."""
    return None if entry.get("memory_mb") is None else sum(entry["memory_mb"].values())


def cost_curve_line(curve: dict[str, Any]) -> str:
    """One line: a model's decode step and v(k) for k = 1..K."""
    vs = " ".join(f"{k}:{v:.2f}" for k, v in enumerate(curve["v"]) if k)
    return (f"verification cost v(k) of {Path(curve['model']).name} at {curve['context']} tokens "
            f"(decode step {curve['step_ms']:.1f} ms): {vs}")


def format_table(doc: dict[str, Any]) -> str:
    """The human summary printed on stdout."""
    llama = any(e["overall"].get("speedup_vs_llamacpp") is not None for e in doc["methods"])
    checked = any(e["overall"].get("checked_outputs") for e in doc["methods"])
    rows = [("method", "tok/s", "vs hf (min-max)", "vs none (min-max)", *(("vs llamacpp (min-max)",) if llama else ()),
             "tau", "accept", "pred", "same", *(("valid", "mask") if checked else ()), "KV B/tok", "mem MB", "RSS MB")]
    for e in doc["methods"]:
        f = e["overall"]
        name = e["name"] + (" [FAILED]" if e["status"] == "failed" else "")
        rows.append((name, _x(f["tokens_per_s"]), _range(f, "speedup_vs_hf"), _range(f, "speedup_vs_none"),
                     *((_range(f, "speedup_vs_llamacpp"),) if llama else ()),
                     _x(f["mean_accepted_length"]), _x(f["acceptance_rate"]), _x(f["predicted_speedup"]),
                     _identity_cell(e), *((_valid_cell(f), _x(f["mask_share"])) if checked else ()),
                     _x(f["kv_bytes_per_token"], 0), _x(memory_total(e), 0), _x(e["rss_mb"], 0)))
    lines = [_columns(rows), ""]
    cats = doc["prompts"]["categories"]
    grid = [("speedup vs none", *cats, "overall")]
    for e in doc["methods"]:
        if e["overall"]["samples"]:
            grid.append((e["name"], *(_x(e["by_category"][c]["speedup_vs_none"]) for c in cats),
                         _x(e["overall"]["speedup_vs_none"])))
    lines += [_columns(grid), ""]
    c = doc["config"]
    lines.append(f"{doc['prompts']['count']} prompts x {c['repeats']} repeat(s), budget {c['max_new_tokens']} tokens, "
                 f"temperature {c['temperature']}, {dtypes(c)}; peak RSS {_x(doc['memory']['peak_rss_mb'], 0)} MB")
    if doc["identical_outputs"] is not None:
        ok = doc["identical_outputs"] == doc["identity_comparisons"]
        lines.append(f"greedy outputs identical to 'none': {doc['identical_outputs']}/{doc['identity_comparisons']}"
                     + ("" if ok else "   !!!! MISMATCH: a lossless method changed the output !!!!"))
    elif doc["identity_note"]:
        lines.append(f"identity {doc['identity_note']}")
    for fl in doc["failed"]:
        lines.append(f"FAILED {fl['name']}: {fl['error']}")
    for curve in doc.get("cost_curves", []):
        lines.append(cost_curve_line(curve))
    lines += [f"note: {n}" for n in doc["notes"]]  # skipped methods are among the notes
    return "\n".join(lines)


def _valid_cell(f: dict[str, Any]) -> str:
    """Answers that follow their prompt's JSON schema, of those checked."""
    return f"{f['valid_outputs']}/{f['checked_outputs']}" if f.get("checked_outputs") else "-"


def _columns(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    out = []
    for j, r in enumerate(rows):
        cells = [str(v).ljust(widths[0]) if i == 0 else str(v).rjust(widths[i]) for i, v in enumerate(r)]
        out.append("  ".join(cells).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# Markdown report and plots

PLOTS = ("speedup_by_category.png", "acceptance_by_position.png", "gamma_sweep.png", "verification_cost.png",
         "accepted_length_by_budget.png")
# Line styles of the controllers in the gamma sweep (dashed is taken by the none/hf references).
CONTROLLER_LINES = {"agreement": ":", "cost": "-.", "confidence": (0, (3, 1, 1, 1, 1, 1)), "adaptive": (0, (6, 2))}


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _n(v: Any) -> str:
    """A JSON value exactly as the JSON file spells it ("-" for null)."""
    return "-" if v is None else json.dumps(v)


def _md_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _md_header(doc: dict[str, Any]) -> list[str]:
    """The run in a few lines: model, prompts, memory, machine, KV cache, and the identity verdict."""
    c, env = doc["config"], doc["environment"]
    cats = doc["prompts"]["categories"]
    out = ["# specdecode bench report", "",
           f"- model: `{c['model']}` ({c['model_source']}), {dtypes(c)}"
           + (f", draft model `{c['draft_model']}`" if c.get("draft_model") else ""),
           f"- prompts: {doc['prompts']['count']} in {len(cats)} categories ({', '.join(cats)}), "
           f"{c['repeats']} repeat(s), budget {c['max_new_tokens']} new tokens, temperature {c['temperature']}",
           f"- peak RSS of the process: {_n(doc['memory']['peak_rss_mb'])} MB; "
           f"torch threads {env.get('torch_threads')}; torch {env.get('torch')}, "
           f"transformers {env.get('transformers')}"]
    if "cpu_model" in env:  # documents written before the machine was recorded lack it
        flags = " ".join(env["cpu_flags"]) or "none of the relevant x86 flags"
        out.append(f"- machine: {env['cpu_model']} ({env['cpu_family']}; {flags}), {env['cpu_count']} CPUs")
    if "kv_dtype" in c:  # documents written before the KV settings existed lack them
        window = "none" if c["kv_window"] is None else f"{c['kv_window']} + {c['kv_sinks']} sinks"
        out.append(f"- KV cache: {c['kv_dtype']} (draft {c['draft_kv_dtype']}), window {window}, budget "
                   f"{_n(c['kv_budget'])} bytes, prefix cache {'on' if c['prefix_cache'] else 'off'}")
    out.append("")
    if doc["identical_outputs"] is not None:
        flag = "" if doc["identical_outputs"] == doc["identity_comparisons"] else " **MISMATCH: lossless methods changed the output**"
        out += [f"Greedy outputs of our speculative methods identical to `none`: "
                f"**{_n(doc['identical_outputs'])} / {_n(doc['identity_comparisons'])}**{flag}", ""]
    elif doc["identity_note"]:
        out += [f"Identity check {doc['identity_note']}.", ""]
    return out


def _md_overall(doc: dict[str, Any]) -> list[str]:
    """Every method's overall figures in one table."""
    out = ["## Overall", "",
           "Tokens/s: median over prompts. Speedups: per-prompt ratio of tokens/s, then median [min, max]. "
           "tau: tokens per target forward. Predicted: E / (k*c + v(k)) with measured acceptance and costs "
           "(compare with the measured speedup vs `none`).", ""]
    rows = []
    llama = any(e["overall"].get("speedup_vs_llamacpp") is not None for e in doc["methods"])
    for e in doc["methods"]:
        f = e["overall"]
        rows.append([f"`{e['name']}`" + (" (failed)" if e["status"] == "failed" else ""), _n(f["tokens_per_s"]),
                     f"{_n(f['speedup_vs_hf'])} [{_n(f['speedup_vs_hf_min'])}, {_n(f['speedup_vs_hf_max'])}]",
                     f"{_n(f['speedup_vs_none'])} [{_n(f['speedup_vs_none_min'])}, {_n(f['speedup_vs_none_max'])}]",
                     *([f"{_n(f.get('speedup_vs_llamacpp'))} [{_n(f.get('speedup_vs_llamacpp_min'))}, "
                        f"{_n(f.get('speedup_vs_llamacpp_max'))}]"] if llama else []),
                     _n(f["mean_accepted_length"]), _n(f["acceptance_rate"]), _n(f["mean_gamma"]),
                     _n(f["predicted_speedup"]),
                     "-" if e["compared_to_none"] is None else f"{e['identical_to_none']}/{e['compared_to_none']}",
                     _n(f["kv_bytes_per_token"]), _n(memory_total(e)), _n(e["rss_mb"]), _n(f["control_share"]),
                     runs_on(e)])
    return out + [_md_table(["method", "tokens/s", "vs hf", "vs none", *(["vs llamacpp"] if llama else []), "tau",
                             "acceptance", "mean gamma", "predicted", "identical", "KV bytes/token", "memory MB",
                             "RSS MB", "control share", "runs on"], rows), "",
                  "memory MB: what the configuration holds (weights, packed copies included, and KV caches); "
                  "RSS MB: the whole process after the method's calls (every method's weights are loaded at once); "
                  "runs on: the kernel of the projections, the dtype and the weight formats (the draft model's after "
                  "`draft`).", ""]


def _md_weights(ok: Sequence[dict[str, Any]]) -> list[str]:
    """Plain decoding in each weight format, with the weights' resident bytes (when there are several)."""
    plains = [e for e in ok if e["family"] == "none" and e.get("weight_mb")]
    if not plains:
        return []
    return ["## Weights", "", "Resident bytes of the target's weights (packed copies and the embedding table "
            "included) and plain decoding in each format.", "",
            _md_table(["method", "weights", "weight MB", "tokens/s", "vs llamacpp"],
                      ([f"`{e['name']}`", e["weights"], _n(e["weight_mb"]), _n(e["overall"]["tokens_per_s"]),
                        _n(e["overall"].get("speedup_vs_llamacpp"))] for e in plains)), ""]


def _md_cost_curves(doc: dict[str, Any]) -> list[str]:
    out = []
    for curve in doc.get("cost_curves", []):
        width = len(curve["v"]) - 1
        out += [f"## Verification cost v(k): {Path(curve['model']).name}", "",
                f"One forward over k drafted tokens relative to a plain decode step ({_n(curve['step_ms'])} ms), "
                f"at {curve['context']} tokens of context, median of {curve['repeats']}.", "",
                _md_table(["k", *(str(k) for k in range(1, width + 1))],
                          [["v(k)", *(_n(v) for v in curve["v"][1:])],
                           ["ms", *(_n(m) for m in curve["verify_ms"][1:])]]), ""]
    return out


def _md_by_category(ok: Sequence[dict[str, Any]], cats: Sequence[str]) -> list[str]:
    out = []
    for title, key in (("Speedup vs `none` by category", "speedup_vs_none"),
                       ("Speedup vs transformers `generate` by category", "speedup_vs_hf"),
                       ("Speedup vs llama.cpp's plain decoding by category", "speedup_vs_llamacpp"),
                       ("Tokens/s by category", "tokens_per_s"), ("tau by category", "mean_accepted_length")):
        if all(e["overall"].get(key) is None for e in ok):
            continue
        out += [f"## {title}", "", _md_table(["method", *cats, "overall"],
                                             ([f"`{e['name']}`", *(_n(e["by_category"][ct][key]) for ct in cats),
                                               _n(e["overall"][key])] for e in ok)), ""]
    return out


def _md_gamma_comparison(doc: dict[str, Any], cats: Sequence[str]) -> list[str]:
    out = []
    for comp in doc.get("gamma_comparison", []):
        best = comp["best_fixed_by_category"]
        out += [f"## Gamma controllers vs fixed gamma: {comp['family']}", "",
                f"Per prompt, the controller's tokens/s over the fixed gamma's, then median: overall against "
                f"`{comp['best_fixed']}` (the best single fixed gamma by median speedup vs `none`), per category "
                f"against that category's best fixed gamma.", "",
                _md_table(["controller", f"vs `{comp['best_fixed']}`", *(f"{ct} (vs `{best[ct]}`)" for ct in cats)],
                          ([f"`{e['name']}`", _n(e["vs_best_fixed"]), *(_n(e["by_category"][ct]) for ct in cats)]
                           for e in comp["controllers"])), ""]
        if any(v is not None for e in comp["controllers"] for v in e.get("by_category_held_out", {}).values()):
            out += ["Per category, held out: on each prompt against the fixed gamma that is best on the "
                    "category's other prompts (the pick above is made on the prompts it is judged on, and "
                    "the best of several noisy medians reads high).", "",
                    _md_table(["controller", *cats], ([f"`{e['name']}`", *(_n(e["by_category_held_out"].get(ct))
                                                                           for ct in cats)]
                                                      for e in comp["controllers"])), ""]
    return out


def _md_acceptance(ok: Sequence[dict[str, Any]]) -> list[str]:
    """Acceptance by draft position, and accepted length by draft size when some method drafted trees."""
    out = []
    with_pos = [e for e in ok if e["overall"]["acceptance_by_position"]]
    if with_pos:
        width = max(len(e["overall"]["acceptance_by_position"]) for e in with_pos)
        out += ["## Acceptance by draft position", "",
                _md_table(["method", *(str(i + 1) for i in range(width))],
                          ([f"`{e['name']}`", *(_n(v) for v in e["overall"]["acceptance_by_position"]),
                            *["-"] * (width - len(e["overall"]["acceptance_by_position"]))] for e in with_pos)), ""]
    by_budget = _by_budget(ok)
    if by_budget:
        width = max(len(e["overall"]["accepted_length_by_budget"]) for e in by_budget)
        out += ["## Accepted length by draft size", "",
                "Tokens emitted per step (accepted + 1), by the tokens (tree nodes) the step drafted; `-` where "
                "no step drafted that many.", "",
                _md_table(["method", "tree steps", *(str(i) for i in range(width))],
                          ([f"`{e['name']}`", _n(e["overall"]["tree_steps"]),
                            *(_n(v) for v in e["overall"]["accepted_length_by_budget"]),
                            *["-"] * (width - len(e["overall"]["accepted_length_by_budget"]))] for e in by_budget)), ""]
    return out


def _md_problems(doc: dict[str, Any]) -> list[str]:
    """Output mismatches, failed methods and notes."""
    out = []
    if doc["identity_mismatches"]:
        out += ["## Output mismatches", "", _md_table(["method", "prompt", "repeat", "first differing token"],
                                                       ([m["method"], m["prompt_id"], str(m["repeat"]),
                                                         str(m["first_difference"])] for m in doc["identity_mismatches"])), ""]
    extra = [f"- **failed** `{f['name']}`: {f['error']}" for f in doc["failed"]]
    extra += [f"- {n}" for n in doc["notes"]]
    if extra:
        out += ["## Notes", "", *extra, ""]
    return out


def markdown(doc: dict[str, Any], plots: Sequence[str] = PLOTS) -> str:
    """The report; every number is the JSON document's value, spelled as in the JSON."""
    cats = doc["prompts"]["categories"]
    ok = [e for e in doc["methods"] if e["overall"]["samples"]]
    out = [*_md_header(doc), *_md_overall(doc), *_md_weights(ok), *_md_cost_curves(doc), *_md_by_category(ok, cats),
           *_md_gamma_comparison(doc, cats), *_md_acceptance(ok), *_md_problems(doc)]
    if plots:
        out += ["## Plots", ""] + [f"![{p[:-4]}]({p})" for p in plots] + [""]
    return "\n".join(out)


def write_report(doc: dict[str, Any], folder: str | Path) -> list[Path]:
    """Writes report.md, results.json and the PNG plots into ``folder``; returns the files written.

    Raises:
        RuntimeError: matplotlib is not installed.
    """
    if not matplotlib_available():
        raise RuntimeError("--report needs matplotlib: pip install 'specdecode[bench]'")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = plot_all(doc, folder)
    (folder / "results.json").write_text(json.dumps(doc, indent=1))
    (folder / "report.md").write_text(markdown(doc, [p.name for p in written]))
    return [folder / "report.md", folder / "results.json", *written]


def plot_all(doc: dict[str, Any], folder: Path) -> list[Path]:
    """Writes the report's PNG plots into ``folder`` (those the document has data for); returns them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [e for e in doc["methods"] if e["overall"]["samples"]]
    palette = plt.get_cmap("tab20")
    # One colour per method, the same in every panel and plot.
    color_of = {e["name"]: palette(i % 20) for i, e in enumerate(ok)}
    written = [_plot_speedup(ok, doc["prompts"]["categories"], color_of, folder, plt),
               _plot_acceptance(ok, color_of, folder, plt), _plot_gamma_sweep(ok, palette, folder, plt),
               _plot_cost_curves(doc.get("cost_curves", []), folder, plt), _plot_by_budget(ok, color_of, folder, plt)]
    return [path for path in written if path is not None]


def _plot_speedup(ok: Sequence[dict[str, Any]], cats: list[str], color_of: dict[str, Any], folder: Path,
                  plt) -> Path | None:
    """Speedup by category per method, against ``none`` and against ``hf`` (a panel each, where measured)."""
    keys = [k for k in ("speedup_vs_none", "speedup_vs_hf") if any(e["overall"][k] is not None for e in ok)]
    if not keys:
        return None
    groups = cats + ["overall"]
    fig, axes = plt.subplots(len(keys), 1, figsize=(max(8.0, 1.3 * len(groups) + 4), 4.2 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        shown = [e for e in ok if e["overall"][key] is not None and not (key == "speedup_vs_none" and e["family"] == "none")
                 and not (key == "speedup_vs_hf" and e["name"] == "hf")]
        width = 0.8 / max(len(shown), 1)
        for i, e in enumerate(shown):
            vals = [e["by_category"][ct][key] for ct in cats] + [e["overall"][key]]
            xs = [g + (i - (len(shown) - 1) / 2) * width for g in range(len(groups))]
            ax.bar(xs, [v if v is not None else 0.0 for v in vals], width, label=e["name"], color=color_of[e["name"]])
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(groups)), groups, rotation=20)
        ax.set_ylabel(f"speedup vs {key.rsplit('_', 1)[1]} (median)")
        ax.set_title(f"Speedup vs {'our plain decoding (none)' if key.endswith('none') else 'transformers generate (hf)'}")
        ax.legend(fontsize=7, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return _save(fig, folder / "speedup_by_category.png", plt)


def _plot_acceptance(ok: Sequence[dict[str, Any]], color_of: dict[str, Any], folder: Path, plt) -> Path:
    """Acceptance by draft position (an empty plot, saying so, when no method drafted)."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    with_pos = [e for e in ok if e["overall"]["acceptance_by_position"]]
    for e in with_pos:
        pos = e["overall"]["acceptance_by_position"]
        ax.plot(range(1, len(pos) + 1), pos, marker="o", label=e["name"], color=color_of[e["name"]])
    width = max((len(e["overall"]["acceptance_by_position"]) for e in with_pos), default=1)
    ax.set_xticks(range(1, width + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (of drafts reaching it)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position" + ("" if with_pos else " (no drafting method ran)"))
    if with_pos:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return _save(fig, folder / "acceptance_by_position.png", plt)


def _plot_gamma_sweep(ok: Sequence[dict[str, Any]], palette, folder: Path, plt) -> Path:
    """tau and tokens/s against gamma per family; controllers (and ``none``, ``hf``) as flat lines."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    families = list(dict.fromkeys(e["family"] for e in ok if e["kind"] == "ours" and e["family"] != "none"))
    # Each family's fixed-gamma curve and each controller its own colour: the ten dark hues first.
    colours = itertools.cycle([palette(i) for i in (*range(0, 20, 2), *range(1, 20, 2))])
    for fam in families:
        fixed = sorted((e for e in ok if e["family"] == fam and isinstance(e["gamma"], int)), key=lambda e: e["gamma"])
        controllers = [e for e in ok if e["family"] == fam and isinstance(e["gamma"], str)]
        fam_colour, ctrl_colours = next(colours), [next(colours) for _ in controllers]
        for ax, key in ((ax1, "mean_accepted_length"), (ax2, "tokens_per_s")):
            pts = [(e["gamma"], e["overall"][key]) for e in fixed if e["overall"][key] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", color=fam_colour, label=fam)
            for e, colour in zip(controllers, ctrl_colours):
                if e["overall"][key] is not None:
                    ax.axhline(e["overall"][key], color=colour, linestyle=CONTROLLER_LINES.get(e["gamma"], ":"),
                               label=e["name"])
    for e in ok:
        if e["name"] in ("none", "hf") and e["overall"]["tokens_per_s"] is not None:
            ax2.axhline(e["overall"]["tokens_per_s"], color="black" if e["name"] == "none" else "grey",
                        linestyle="--", label=e["name"])
    ax1.set_title("tau (tokens per target forward) vs gamma; controllers as flat lines")
    ax2.set_title("tokens/s (median over prompts) vs gamma")
    gammas = sorted({e["gamma"] for e in ok if isinstance(e["gamma"], int) and e["kind"] == "ours"})
    for ax in (ax1, ax2):
        if gammas:
            ax.set_xticks(gammas)
        ax.set_xlabel("gamma (tokens drafted per step)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    ax1.set_ylabel("tau")
    ax2.set_ylabel("tokens/s")
    fig.tight_layout()
    return _save(fig, folder / "gamma_sweep.png", plt)


def _plot_cost_curves(curves: Sequence[dict[str, Any]], folder: Path, plt) -> Path | None:
    """The verification cost curves v(k) against k + 1 plain steps."""
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for curve in curves:
        ax.plot(range(len(curve["v"])), curve["v"], marker="o",
                label=f"{Path(curve['model']).name} (step {curve['step_ms']:.1f} ms)")
    ax.plot([0, len(curves[0]["v"]) - 1], [1, len(curves[0]["v"])], color="grey", linestyle=":",
            label="linear: k+1 steps")
    ax.set_ylim(0, max(3.0, max(max(c["v"]) for c in curves) * 1.1))
    ax.set_xlabel("drafted tokens verified (k)")
    ax.set_ylabel("v(k): cost / one decode step")
    ax.set_title("Verification cost curve")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, folder / "verification_cost.png", plt)


def _drafts_trees(family: str) -> bool:
    return family in registry.names() and registry.spec(family).tree


def _plot_by_budget(ok: Sequence[dict[str, Any]], color_of: dict[str, Any], folder: Path, plt) -> Path | None:
    """Accepted length against the draft's (tree's) size, when some method drafted trees."""
    by_budget = _by_budget(ok)
    if not by_budget:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for e in by_budget:
        pts = [(i, v) for i, v in enumerate(e["overall"]["accepted_length_by_budget"]) if v is not None and i]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=e["name"], color=color_of[e["name"]],
                    linestyle="-" if _drafts_trees(e["family"]) else "--")
    ax.set_xlabel("tokens drafted in the step (tree nodes for trees)")
    ax.set_ylabel("tokens emitted per step")
    ax.set_title("Accepted length by draft size (solid: trees, dashed: chains)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return _save(fig, folder / "accepted_length_by_budget.png", plt)


def _by_budget(ok: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drafting methods with accepted lengths by draft size, when some method drafted trees."""
    drafting = [e for e in ok if e["family"] != "none" and e["overall"].get("accepted_length_by_budget")]
    return drafting if any(e["overall"].get("tree_steps") for e in drafting) else []


def _save(fig, path: Path, plt) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
