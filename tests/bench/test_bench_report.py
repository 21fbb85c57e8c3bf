"""Aggregation arithmetic on synthetic samples: medians, per-prompt ratios, pooled counters, identity."""

from __future__ import annotations

import pytest

from specdecode.bench.methods import Method
from specdecode.bench.report import (aggregate, build_document, format_table, gamma_comparison, markdown,
                                     prompt_tokens_per_s)
from specdecode.bench.runner import BenchConfig, RunResult, Sample
from specdecode.prompts import Prompt


def _stats(generated: int, forwards: int, drafted: list[int], accepted: list[int], predicted: float,
           kv: tuple[int, float, float] = (1000, 100.0, 0.0)) -> dict:
    return {"tokens_generated": generated, "target_forwards": forwards, "drafted_tokens": sum(drafted),
            "accepted_tokens": sum(accepted), "drafted_by_position": drafted, "accepted_by_position": accepted,
            "predicted_speedup": predicted, "control_s": 0.001 * forwards, "wall_s": 0.1 * forwards,
            "kv_bytes": kv[0], "kv_bytes_per_token": kv[1], "draft_kv_bytes_per_token": kv[2]}


def _s(method, pid, cat, tokens, seconds, repeat=0, stats=None, ids=None):
    return Sample(method, pid, cat, repeat, tokens, seconds, stats, "length", ids if ids is not None else [1] * tokens)


@pytest.fixture
def samples():
    # p1, p2 in "x"; p3 in "y". none: 10 tok/s everywhere (p1 repeats 8 and 12 -> median 10).
    # hf: 5, 10, 20 tok/s. ngram:g2: 20, 15, 40 tok/s; p3's output differs from none's.
    none_stats = _stats(10, 10, [], [], 1.0)
    return [
        _s("none", "p1", "x", 10, 1.25, 0, none_stats), _s("none", "p1", "x", 10, 10 / 12, 1, none_stats),
        _s("none", "p2", "x", 10, 1.0, 0, none_stats), _s("none", "p3", "y", 10, 1.0, 0, none_stats),
        _s("hf", "p1", "x", 10, 2.0), _s("hf", "p1", "x", 10, 2.0, 1), _s("hf", "p2", "x", 10, 1.0),
        _s("hf", "p3", "y", 10, 0.5),
        _s("ngram:g2", "p1", "x", 10, 0.5, 0, _stats(10, 5, [5, 4], [4, 1], 1.5, (2000, 50.0, 5.0))),
        _s("ngram:g2", "p1", "x", 10, 0.5, 1, _stats(10, 5, [5, 4], [4, 1], 1.7, (2400, 60.0, 5.0))),
        _s("ngram:g2", "p2", "x", 12, 0.8, 0, _stats(12, 6, [6, 6], [6, 0], 2.0, (3000, 70.0, 6.0)), ids=[1] * 12),
        _s("ngram:g2", "p3", "y", 10, 0.25, 0, _stats(10, 4, [4, 4, 2], [4, 2, 0], 3.0, (2200, 80.0, 7.0)),
           ids=[2] * 10),
    ]


def test_prompt_tokens_per_s_is_the_median_over_repeats(samples):
    tps = prompt_tokens_per_s(samples)
    assert tps["none"] == pytest.approx({"p1": 10.0, "p2": 10.0, "p3": 10.0})
    assert tps["hf"] == pytest.approx({"p1": 5.0, "p2": 10.0, "p3": 20.0})
    assert tps["ngram:g2"] == pytest.approx({"p1": 20.0, "p2": 15.0, "p3": 40.0})


def test_aggregate(samples):
    out = aggregate(samples, ["none", "ngram:g2", "hf"], ["x", "y"], {"x": ["p1", "p2"], "y": ["p3"]}, identity=True)
    o = out["ngram:g2"]["overall"]
    assert o["prompts"] == 3 and o["samples"] == 4 and o["tokens"] == 42
    assert o["tokens_per_s"] == 20.0 and o["tokens_per_s_min"] == 15.0 and o["tokens_per_s_max"] == 40.0
    # per-prompt ratios vs none: 2, 1.5, 4 -> median 2; vs hf: 4, 1.5, 2 -> median 2
    assert (o["speedup_vs_none"], o["speedup_vs_none_min"], o["speedup_vs_none_max"]) == (2.0, 1.5, 4.0)
    assert (o["speedup_vs_hf"], o["speedup_vs_hf_min"], o["speedup_vs_hf_max"]) == (2.0, 1.5, 4.0)
    # pooled: 42 tokens / 20 forwards; accepted 4+1+4+1+6+0+4+2 = 22 of 5+4+5+4+6+6+4+4+2 = 40 drafted
    assert o["mean_accepted_length"] == 2.1
    assert o["acceptance_rate"] == 0.55
    assert o["acceptance_by_position"] == [round(18 / 20, 4), round(4 / 18, 4), 0.0]
    assert o["mean_gamma"] == 2.0
    assert o["predicted_speedup"] == 1.85  # median of 1.5, 1.7, 2.0, 3.0
    assert o["control_share"] == 0.01  # 1 ms of decisions per 100 ms step, pooled
    # KV memory: the largest cache of any call; per-token figures are medians over calls
    assert o["kv_bytes"] == 3000 and o["kv_bytes_per_token"] == 65.0 and o["draft_kv_bytes_per_token"] == 5.5
    # identity: p1 (both repeats) identical, p2 longer -> differs, p3 other tokens -> differs
    assert (o["identical_to_none"], o["compared_to_none"]) == (2, 4)

    x, y = out["ngram:g2"]["by_category"]["x"], out["ngram:g2"]["by_category"]["y"]
    assert x["prompts"] == 2 and x["tokens_per_s"] == 17.5 and x["speedup_vs_none"] == 1.75
    assert x["speedup_vs_hf"] == 2.75 and x["acceptance_by_position"] == [0.875, 0.1429]
    assert (x["identical_to_none"], x["compared_to_none"]) == (2, 3)
    assert y["tokens_per_s"] == 40.0 and y["speedup_vs_hf"] == 2.0 and y["mean_accepted_length"] == 2.5
    assert (y["identical_to_none"], y["compared_to_none"]) == (0, 1)

    n, h = out["none"]["overall"], out["hf"]["overall"]
    assert n["speedup_vs_none"] == 1.0 and n["speedup_vs_hf"] == 1.0  # ratios 2, 1, 0.5
    assert n["mean_accepted_length"] == 1.0 and n["acceptance_rate"] is None and n["acceptance_by_position"] == []
    assert n["identical_to_none"] is None  # the reference is not compared with itself
    assert h["speedup_vs_hf"] == 1.0 and h["speedup_vs_none"] == 1.0
    assert h["mean_accepted_length"] is None and h["predicted_speedup"] is None
    assert h["kv_bytes"] is None and h["kv_bytes_per_token"] is None  # a peer's cache is not observable
    assert n["kv_bytes"] == 1000 and n["kv_bytes_per_token"] == 100.0


def test_missing_baseline_gives_null_speedups(samples):
    out = aggregate([s for s in samples if s.method != "hf"], ["none", "ngram:g2"], ["x", "y"],
                    {"x": ["p1", "p2"], "y": ["p3"]}, identity=False)
    o = out["ngram:g2"]["overall"]
    assert o["speedup_vs_hf"] is None and o["speedup_vs_hf_min"] is None
    assert o["identical_to_none"] is None and o["compared_to_none"] is None


def test_a_method_without_samples_in_a_category_has_empty_figures(samples):
    out = aggregate([s for s in samples if not (s.method == "hf" and s.prompt_id == "p3")], ["hf"], ["x", "y"],
                    {"x": ["p1", "p2"], "y": ["p3"]}, identity=True)
    y = out["hf"]["by_category"]["y"]
    assert y["prompts"] == 0 and y["tokens_per_s"] is None and y["speedup_vs_none"] is None


def _doc(samples, gammas=None, by_category=None):
    gammas = gammas or {"none": None, "ngram:g2": None, "hf": None}
    by_category = by_category or {"x": ["p1", "p2"], "y": ["p3"]}
    figs = aggregate(samples, list(gammas), list(by_category), by_category, identity=True)
    methods = [{"name": n, "family": n.split(":")[0], "kind": "peer" if n == "hf" else "ours", "gamma": gammas[n],
                "params": {}, "status": "ok", "error": None, "rss_mb": 100.0, **figs[n],
                "memory_mb": None if n == "hf" else {"target_weights": 50.0, "target_kv": 10.0},
                "identical_to_none": figs[n]["overall"]["identical_to_none"],
                "compared_to_none": figs[n]["overall"]["compared_to_none"]} for n in figs]
    return {"config": {"model": "m", "model_source": "m", "torch_dtype": "float32", "repeats": 2,
                       "max_new_tokens": 10, "temperature": 0.0, "draft_model": None},
            "environment": {}, "prompts": {"count": 3, "categories": list(by_category)}, "methods": methods,
            "identical_outputs": 2, "identity_comparisons": 4, "identity_note": None,
            "identity_mismatches": [{"method": "ngram:g2", "prompt_id": "p3", "repeat": 0, "first_difference": 0}],
            "skipped": [], "failed": [], "notes": ["a note"], "memory": {"peak_rss_mb": 123.4},
            "cost_curves": [{"model": "/x/m.gguf", "context": 200, "repeats": 3, "step_ms": 20.0,
                             "verify_ms": [20.0, 21.0, 22.0], "v": [1.0, 1.05, 1.1]}]}


def test_text_outputs_flag_mismatches(samples):
    doc = _doc(samples)
    table = format_table(doc)
    assert "MISMATCH" in table and "2/4 !!" in table and "note: a note" in table
    assert "v(k) of m.gguf at 200 tokens (decode step 20.0 ms): 1:1.05 2:1.10" in table
    md = markdown(doc, plots=[])
    assert "**MISMATCH" in md and "## Output mismatches" in md
    assert "| `ngram:g2` | 20.0 | 2.0 [1.5, 4.0] | 2.0 [1.5, 4.0] | 2.1 | 0.55 | 2.0 | 1.85 | 2/4 | 65.0 | 60.0 | 100.0 |" in md
    assert "| `hf` |" in md and "| - | - | 100.0 |" in md  # peers hold no accounted memory
    assert "## Verification cost v(k): m.gguf" in md and "| v(k) | 1.05 | 1.1 |" in md
    assert "## KV cache" not in md  # an older document without KV settings still renders
    assert "65" in table.splitlines()[3]  # the KV B/tok column


def test_gamma_comparison_pairs_each_controller_with_the_best_fixed_gamma():
    # none: 10 tok/s. g1: 12, 12, 30; g2: 14, 13, 20; cost: 15, 13, 33 (p1, p2 in "x"; p3 in "y").
    speeds = {"none": (10, 10, 10), "ngram:g1": (12, 12, 30), "ngram:g2": (14, 13, 20), "ngram:cost": (15, 13, 33)}
    samples = [_s(m, p, c, 10, 10 / v) for m, vs in speeds.items() for (p, c), v in zip(
        [("p1", "x"), ("p2", "x"), ("p3", "y")], vs)]
    names = list(speeds)
    figs = aggregate(samples, names, ["x", "y"], {"x": ["p1", "p2"], "y": ["p3"]}, identity=False)
    methods = [{"name": n, "family": n.split(":")[0], "gamma": {"none": None, "ngram:g1": 1, "ngram:g2": 2,
                                                                 "ngram:cost": "cost"}[n],
                "status": "ok", **figs[n]} for n in names]
    (comp,) = gamma_comparison(methods, prompt_tokens_per_s(samples), {"x": ["p1", "p2"], "y": ["p3"]})
    # vs none: g1 1.2, 1.2, 3.0 -> 1.2; g2 1.4, 1.3, 2.0 -> 1.4: g2 is the best single fixed gamma
    assert comp["family"] == "ngram" and comp["best_fixed"] == "ngram:g2"
    assert comp["best_fixed_by_category"] == {"x": "ngram:g2", "y": "ngram:g1"}
    (cost,) = comp["controllers"]
    assert cost["name"] == "ngram:cost"
    assert cost["vs_best_fixed"] == round(15 / 14, 4)  # per prompt 15/14, 13/13, 33/20 -> median
    assert cost["by_category"] == {"x": round((15 / 14 + 1.0) / 2, 4), "y": 1.1}
    assert cost["by_category_held_out"] == {"x": round((15 / 14 + 1.0) / 2, 4), "y": None}  # y: one prompt
    # No controller or a single fixed gamma: nothing to compare.
    assert gamma_comparison(methods[:3], prompt_tokens_per_s(samples), {"x": ["p1", "p2"], "y": ["p3"]}) == []
    assert gamma_comparison([methods[0], methods[1], methods[3]], prompt_tokens_per_s(samples),
                            {"x": ["p1", "p2"], "y": ["p3"]}) == []


def test_held_out_comparison_picks_each_prompts_fixed_gamma_on_the_other_prompts():
    # One category, none at 10 tok/s. g1: 20, 11, 11 (one lucky prompt); g2: 12 everywhere; ctrl: 12.
    # On all three prompts g2 is best (median 1.2 vs 1.1): ctrl reads 1.0 against it. Leaving p2 out, g1
    # is best on p1 and p3 (median 1.55), so p2 is judged against g1 (12/11), likewise p3; p1 against g2.
    speeds = {"none": (10, 10, 10), "ngram:g1": (20, 11, 11), "ngram:g2": (12, 12, 12), "ngram:adaptive": (12, 12, 12)}
    ids = ["p1", "p2", "p3"]
    samples = [_s(m, p, "x", 10, 10 / v) for m, vs in speeds.items() for p, v in zip(ids, vs)]
    doc = _doc(samples, {"none": None, "ngram:g1": 1, "ngram:g2": 2, "ngram:adaptive": "adaptive"}, {"x": ids})
    (comp,) = gamma_comparison(doc["methods"], prompt_tokens_per_s(samples), {"x": ids})
    (ctrl,) = comp["controllers"]
    assert comp["best_fixed_by_category"] == {"x": "ngram:g2"} and ctrl["by_category"] == {"x": 1.0}
    assert ctrl["by_category_held_out"] == {"x": round(12 / 11, 4)}
    md = markdown({**doc, "gamma_comparison": [comp]}, plots=[]).splitlines()
    rows = [line for line in md if line.startswith("| `ngram:adaptive` | 1.0")]
    assert rows == ["| `ngram:adaptive` | 1.0 | 1.0 |", f"| `ngram:adaptive` | {round(12 / 11, 4)} |"]


def test_the_document_records_each_methods_kernel_and_dtype_and_the_peers_dtype():
    def method(name, family, gamma=None, **runs_on):
        return Method(name, family, lambda ids, seed: None, gamma, **runs_on)

    methods = [method("none", "none", kernel="onednn", dtype="bfloat16"),
               method("draft:g2", "draft", 2, kernel="onednn", dtype="bfloat16", draft_kernel="int8",
                      draft_dtype="bfloat16"),
               method("hf", "hf", kernel="transformers", dtype="float32")]
    samples = [_s(m.name, "p1", "x", 10, 1.0) for m in methods]
    result = RunResult(
        config=BenchConfig(model="m", draft_model="d"), prompts=[Prompt("p1", "x", "hello")], prompt_tokens={"p1": 3},
        methods=methods, samples=samples, skipped=[], failed={"hf-lookup": "RuntimeError: no"}, notes=[],
        identity_checked=True, identity_comparisons=1, identity_mismatches=[], peer_agreement={}, rss_mb={},
        peak_rss_mb=1.0, rss_after_load_mb=1.0, model_source="m", draft_source="d", torch_dtype="bfloat16",
        peer_dtype="float32", linear_kernel="onednn", load_s=1.0, run_s=1.0)
    env = {"cpu_model": "Some CPU", "cpu_family": "x86-64 AVX2", "cpu_flags": ["avx2", "fma"], "cpu_count": 2}
    doc = build_document(result, {"model": "m", "draft_model": "d", "repeats": 1, "max_new_tokens": 10,
                                  "temperature": 0.0}, env)

    assert doc["config"]["torch_dtype"] == "bfloat16" and doc["config"]["peer_dtype"] == "float32"
    assert doc["environment"] == env
    runs_on = {e["name"]: (e["kernel"], e["dtype"], e["draft_kernel"], e["draft_dtype"]) for e in doc["methods"]}
    assert runs_on == {"none": ("onednn", "bfloat16", None, None), "draft:g2": ("onednn", "bfloat16", "int8", "bfloat16"),
                       "hf": ("transformers", "float32", None, None), "hf-lookup": (None, None, None, None)}
    md = markdown(doc, plots=[])
    assert "dtype bfloat16 (peers float32), projections on onednn" in md
    assert "- machine: Some CPU (x86-64 AVX2; avx2 fma), 2 CPUs" in md
    overall = md.split("## Overall")[1].split("\n\n")[2].splitlines()  # the table: header, rule, rows
    assert overall[0].endswith("| control share | runs on |")
    assert [row.rsplit(" | ", 1)[1] for row in overall[2:]] == [
        "onednn bfloat16 |", "onednn bfloat16; draft int8 bfloat16 |", "transformers float32 |", "- |"]
    assert "dtype bfloat16 (peers float32), projections on onednn" in format_table(doc)


def test_an_older_document_without_the_machine_and_peer_dtype_still_renders(samples):
    md = markdown(_doc(samples), plots=[])
    assert "- model: `m` (m), dtype float32\n" in md and "- machine:" not in md
    hf = next(line for line in md.splitlines() if line.startswith("| `hf` |"))
    assert hf.endswith("| - |")  # no per-method record: "runs on" is "-"
