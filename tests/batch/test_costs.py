"""remembered_curve: a cost curve is measured once per setting and read back after; another setting, a
damaged file or an unwritable folder means measuring (never a wrong or missing curve)."""

from __future__ import annotations

import pytest

from specdecode.batch.costs import remembered_curve

SETTING = {"config": "tiny", "threads": 2, "sizes": [1, 2, 3]}


class Measure:
    def __init__(self, curve):
        self.curve, self.calls = curve, 0

    def __call__(self):
        self.calls += 1
        return list(self.curve)


def test_measured_once_then_remembered(tmp_path):
    measure = Measure([0.01, 0.012, 0.013])
    assert remembered_curve(SETTING, measure, tmp_path) == measure.curve
    assert remembered_curve(dict(SETTING), measure, tmp_path) == measure.curve
    assert measure.calls == 1


@pytest.mark.parametrize("change", [{"threads": 1}, {"sizes": [1, 2]}, {"cpu": "another"}])
def test_another_setting_is_measured_again(tmp_path, change):
    remembered_curve(SETTING, Measure([0.01, 0.02, 0.03]), tmp_path)
    other = Measure([0.5] * len({**SETTING, **change}["sizes"]))
    assert remembered_curve({**SETTING, **change}, other, tmp_path) == other.curve and other.calls == 1


@pytest.mark.parametrize("content", ["", "{not json", '{"what": {}, "seconds": [1]}', "[1, 2]"])
def test_a_damaged_file_is_measured_again(tmp_path, content):
    remembered_curve(SETTING, Measure([0.01, 0.02, 0.03]), tmp_path)
    (saved,) = tmp_path.glob("*.json")
    saved.write_text(content)
    measure = Measure([0.04, 0.05, 0.06])
    assert remembered_curve(SETTING, measure, tmp_path) == measure.curve and measure.calls == 1


def test_an_unwritable_folder_still_gives_the_measurement(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    measure = Measure([0.01, 0.02, 0.03])
    assert remembered_curve(SETTING, measure, blocker / "costs") == measure.curve
    assert remembered_curve(SETTING, measure, blocker / "costs") == measure.curve and measure.calls == 2
