"""benchmarks/library_ngram_load.py --modeled: each step priced at the median of all steps with its rows, pooled over
methods and rounds, plus the run's own planning; the machine's drift between runs then drops out."""

from __future__ import annotations

import pytest

from repo_scripts import load_script


@pytest.fixture(scope="module")
def load():
    return load_script("benchmarks/library_ngram_load.py")


def test_steps_are_priced_by_their_rows_and_planning_is_added(load):
    # Plain ran on a slow minute (its 8-row steps 12 ms), the drafter on a fast one (8 ms): pooled, an 8-row step costs
    # the median 10 ms for both; the drafter's two 16-row steps cost their own 16 ms, and its planning is added.
    steps = {"none": [[(8, 0.012, 0.001)] * 4],
             "auto": [[(8, 0.008, 0.002)] * 4 + [(16, 0.016, 0.002), (16, 0.016, 0.002)]]}
    seconds = load.modeled(steps)
    assert seconds["none"] == [pytest.approx(4 * 0.010 + 4 * 0.001)]
    assert seconds["auto"] == [pytest.approx(4 * 0.010 + 2 * 0.016 + 6 * 0.002)]
