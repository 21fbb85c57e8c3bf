"""benchmarks/bench_totals.py: totals weigh each prompt by its time, where the report's median of ratios does not."""

from __future__ import annotations

import math

import pytest

from repo_scripts import load_script


@pytest.fixture(scope="module")
def bench_totals():
    return load_script("benchmarks/bench_totals.py")


def _sample(method, prompt, category, tokens, seconds):
    return dict(method=method, prompt_id=prompt, category=category, tokens=tokens, seconds=seconds,
                tokens_per_s=tokens / seconds)


def test_totals_are_summed_tokens_over_summed_seconds_against_plain(bench_totals):
    # A long prompt where the drafter gains nothing and a short one where it doubles: the total is pulled to the long
    # prompt's ratio (11 tokens/s over 10), the geometric mean sits between, per category each its own.
    samples = [_sample("none", "a", "chat", 100, 10.0), _sample("none", "b", "code", 10, 1.0),
               _sample("x", "a", "chat", 100, 10.0), _sample("x", "b", "code", 10, 0.5)]
    rows = bench_totals.totals(samples)
    assert rows["none"] == {"overall": 1.0, "chat": 1.0, "code": 1.0, "geomean": 1.0}
    assert rows["x"]["overall"] == pytest.approx((110 / 10.5) / (110 / 11.0))
    assert rows["x"]["chat"] == pytest.approx(1.0) and rows["x"]["code"] == pytest.approx(2.0)
    assert rows["x"]["geomean"] == pytest.approx(math.sqrt(2.0))


def test_a_run_without_plain_decoding_is_refused(bench_totals):
    with pytest.raises(SystemExit, match="no plain decoding"):
        bench_totals.totals([_sample("x", "a", "chat", 10, 1.0)])


def test_against_takes_the_best_other_drafter_per_column_and_leaves_out_its_own(bench_totals):
    rows = {"none": {"overall": 1.0, "chat": 1.0}, "auto:adaptive": {"overall": 1.2, "chat": 1.5},
            "auto:agreement": {"overall": 2.0, "chat": 2.0},  # auto's own: not a single pair to beat
            "ngram:adaptive": {"overall": 1.5, "chat": 1.0}, "suffix:adaptive": {"overall": 1.0, "chat": 1.2}}
    ratios = bench_totals.against([rows], "auto:adaptive")
    assert ratios["overall"] == (pytest.approx(1.2 / 1.5), "ngram:adaptive")
    assert ratios["chat"] == (pytest.approx(1.5 / 1.2), "suffix:adaptive")
    with pytest.raises(SystemExit, match="no such method"):
        bench_totals.against([rows], "eagle:adaptive")


def test_rounds_are_paired_each_ratio_taken_within_its_round(bench_totals):
    # Three rounds, the second on a slow machine for auto's turn: by the medians of the methods' own figures auto reads
    # 1.1 / 1.2 = 0.92x ngram, but paired within each round it is ahead in two of three (1.1, 0.5, 1.05 -> 1.05).
    def rnd(auto, ngram):
        return {"none": {"overall": 1.0}, "auto:adaptive": {"overall": auto}, "ngram:adaptive": {"overall": ngram}}
    rounds = [rnd(1.1, 1.0), rnd(1.0, 2.0), rnd(1.26, 1.2)]
    assert bench_totals.medians(rounds)["ngram:adaptive"]["overall"] == pytest.approx(1.2)
    assert bench_totals.against(rounds, "auto:adaptive")["overall"] == (pytest.approx(1.05), "ngram:adaptive")


def test_runs_of_other_methods_or_prompts_are_not_paired(bench_totals):
    run = {"samples": [_sample("none", "a", "chat", 10, 1.0), _sample("x", "a", "chat", 10, 0.5)]}
    bench_totals.check_rounds([run, run], ["r1", "r2"])  # rounds of one command
    other_prompt = {"samples": [_sample("none", "b", "chat", 10, 1.0), _sample("x", "b", "chat", 10, 0.5)]}
    with pytest.raises(SystemExit, match="r2: its prompts differ from r1's"):
        bench_totals.check_rounds([run, other_prompt], ["r1", "r2"])
    with pytest.raises(SystemExit, match="r3: its methods differ"):
        bench_totals.check_rounds([run, run, {"samples": run["samples"][:1]}], ["r1", "r2", "r3"])
