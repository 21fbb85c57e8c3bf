"""Step records: JSON lines in, checked records out."""

from __future__ import annotations

import json

import pytest

from specdecode.control.records import RecordError, read_records, record_json, step_record
from control_helpers import ctx, record


def test_a_record_round_trips_through_json(tmp_path):
    rec = record(3, 1, draft_s=0.01, verify_s=0.04, requested=4, signals=[(0.9, 0.2), (0.5, 1.1), (0.3, 2.0)],
                 context=ctx(remaining=20, context_len=300, kv="int8"))
    line = record_json(rec, ("top1", "entropy"), model="m", method="layerskip:cost", drafter="layerskip",
                       prompt_id="p1", category="qa", repeat=0, step=7)
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps(line) + "\n\n")
    (back,) = read_records([path])
    assert back["method"] == "layerskip:cost" and back["step"] == 7 and back["kv"] == "int8"
    assert step_record(back) == rec


def _line(**change):
    line = record_json(record(2, 1, signals=[(0.5,), (0.2,)]), ("s",), model="m", method="ngram:g2", drafter="ngram")
    line.update(change)
    return line


@pytest.mark.parametrize("line, message", [
    ("{not json", r"steps.jsonl:2: not JSON"),
    ("[1, 2]", r"steps.jsonl:2: not a JSON object"),
    (json.dumps(_line(version=9)), r"steps.jsonl:2: version 9, expected 1"),
    (json.dumps(_line(drafted=-1)), r"'drafted' must be a number >= 0, got -1"),
    (json.dumps(_line(accepted=3)), r"accepted exceeds drafted"),
    (json.dumps(_line(signals=[[0.5]])), r"1 signals for 2 drafted tokens"),
    (json.dumps(_line(signals=[[0.5], [0.1, 0.2]])), r"is not 1 finite numbers"),
    (json.dumps(_line(model=None)), r"'model' must be a string"),
    (json.dumps(_line(cache_fill=1.5)), r"'cache_fill' must be null or a number in 0..1, got 1.5"),
])
def test_bad_lines_are_named_by_file_and_line(tmp_path, line, message):
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps(_line()) + "\n" + line + "\n")
    with pytest.raises(RecordError, match=message):
        read_records([path])


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(RecordError, match="cannot read step records .*nope.jsonl"):
        read_records([tmp_path / "nope.jsonl"])
