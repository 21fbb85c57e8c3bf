"""remembered_curve: a cost curve is measured once per setting and read back after; another setting, a
damaged file or an unwritable folder means measuring (never a wrong or missing curve); a curve remembered from a
busy machine is found out at the next start and measured again, and so is one where a size cost more than a
larger one."""

from __future__ import annotations

import pytest

from specdecode.batch.costs import CURVE_RETRIES, remembered_curve

SIZES = [1, 2, 3]
SETTING = {"config": "tiny", "threads": 2, "sizes": SIZES}


class Measure:
    """Seconds per size from ``curve`` (size n at index n - 1); counts the sizes it was asked to time."""

    def __init__(self, curve):
        self.curve, self.calls, self.timed = curve, 0, []

    def __call__(self, sizes):
        self.calls += 1
        self.timed.append(list(sizes))
        return [self.curve[n - 1] for n in sizes]


def test_measured_once_then_remembered(tmp_path):
    measure = Measure([0.01, 0.012, 0.013])
    assert remembered_curve(SETTING, SIZES, measure, tmp_path) == measure.curve
    assert remembered_curve(dict(SETTING), SIZES, measure, tmp_path) == measure.curve
    assert measure.timed == [SIZES, [1, 3]]  # a whole curve, then only its ends checked


@pytest.mark.parametrize("change", [{"threads": 1}, {"sizes": [1, 2]}, {"cpu": "another"}])
def test_another_setting_is_measured_again(tmp_path, change):
    remembered_curve(SETTING, SIZES, Measure([0.01, 0.02, 0.03]), tmp_path)
    sizes = {**SETTING, **change}["sizes"]
    other = Measure([0.5] * len(sizes))
    assert remembered_curve({**SETTING, **change}, sizes, other, tmp_path) == other.curve and other.calls == 1


@pytest.mark.parametrize("content", ["", "{not json", '{"what": {}, "seconds": [1]}', "[1, 2]"])
def test_a_damaged_file_is_measured_again(tmp_path, content):
    remembered_curve(SETTING, SIZES, Measure([0.01, 0.02, 0.03]), tmp_path)
    (saved,) = tmp_path.glob("*.json")
    saved.write_text(content)
    measure = Measure([0.04, 0.05, 0.06])
    assert remembered_curve(SETTING, SIZES, measure, tmp_path) == measure.curve and measure.calls == 1


def test_an_unwritable_folder_still_gives_the_measurement(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    measure = Measure([0.01, 0.02, 0.03])
    assert remembered_curve(SETTING, SIZES, measure, blocker / "costs") == measure.curve
    assert remembered_curve(SETTING, SIZES, measure, blocker / "costs") == measure.curve and measure.calls == 2


@pytest.mark.parametrize("quiet", [[0.01, 0.05, 0.06], [0.04, 0.042, 0.045]])
def test_a_curve_timed_on_a_busy_machine_is_measured_again(tmp_path, quiet):
    # Drift fixed: a curve timed while a test run held the cores (SmolLM2's 1-row forward remembered at 32 ms, 5
    # rows at 163 ms, against 5 and 11 ms quiet) priced every draft in a batch for good.
    remembered_curve(SETTING, SIZES, Measure([0.04, 0.05, 0.06]), tmp_path)
    measure = Measure(quiet)  # either end now faster than remembered
    assert remembered_curve(SETTING, SIZES, measure, tmp_path) == quiet
    assert measure.timed == [[1, 3], SIZES]
    assert remembered_curve(SETTING, SIZES, Measure([0.2, 0.2, 0.2]), tmp_path) == quiet  # busier now: kept


def test_a_curve_a_little_slower_now_is_kept(tmp_path):
    remembered_curve(SETTING, SIZES, Measure([0.01, 0.02, 0.03]), tmp_path)
    measure = Measure([0.0085, 0.02, 0.026])  # within the tolerance of timing noise
    assert remembered_curve(SETTING, SIZES, measure, tmp_path) == [0.01, 0.02, 0.03] and measure.calls == 1


class Timings:
    """Each call the next of ``curves`` (seconds per size, size n at index n - 1); counts the calls."""

    def __init__(self, *curves):
        self.curves, self.calls = list(curves), 0

    def __call__(self, sizes):
        curve = self.curves[min(self.calls, len(self.curves) - 1)]
        self.calls += 1
        return [curve[n - 1] for n in sizes]


def test_a_size_timed_above_a_larger_one_is_timed_again(tmp_path):
    # Noise only adds time: the fastest of both timings per size is kept (the 2-row outlier goes, the rest stay).
    measure = Timings([0.010, 0.030, 0.020], [0.012, 0.013, 0.021])
    assert remembered_curve(SETTING, SIZES, measure, tmp_path) == [0.010, 0.013, 0.020] and measure.calls == 2
    # A slope within the slack is a curve, not noise: timed once.
    assert remembered_curve({**SETTING, "threads": 1}, SIZES, Timings([0.010, 0.0105, 0.0100]), tmp_path) \
        == [0.010, 0.0105, 0.0100]


def test_a_curve_that_stays_disturbed_is_kept_after_the_retries(tmp_path):
    measure = Timings([0.010, 0.030, 0.020])
    assert remembered_curve(SETTING, SIZES, measure, tmp_path) == [0.010, 0.030, 0.020]
    assert measure.calls == 1 + CURVE_RETRIES


def test_a_remembered_curve_with_a_disturbed_size_is_measured_again(tmp_path):
    # Its ends pass the start's check (the outlier sits between them), yet it is not kept.
    remembered_curve(SETTING, SIZES, Timings([0.010, 0.030, 0.020]), tmp_path)
    measure = Timings([0.010, 0.012, 0.020])
    assert remembered_curve(SETTING, SIZES, measure, tmp_path) == [0.010, 0.012, 0.020] and measure.calls == 1
    assert remembered_curve(SETTING, SIZES, Timings([0.5, 0.5, 0.5]), tmp_path) == [0.010, 0.012, 0.020]
