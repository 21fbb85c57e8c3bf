"""Controller files: round trip, the shipped default, and clear failures on damaged or mismatched files."""

from __future__ import annotations

import json

import pytest

from specdecode.control import ControllerFileError, controller_factory
from specdecode.control.model_file import (CONTEXT_FEATURES, DEFAULT_FILE, AcceptanceModel, checksum, feature_names,
                                           feature_row, load_controller_file, save_controller_file)
from specdecode.drafters.base import MODEL_SIGNALS
from specdecode.drafters.ngram import NGRAM_SIGNALS
from control_helpers import ctx


def _model(drafter: str = "layerskip", signals=MODEL_SIGNALS) -> AcceptanceModel:
    names = feature_names(signals)
    return AcceptanceModel(drafter, names, tuple(0.1 * (i + 1) for i in range(len(names))), -0.5, ("tiny",), drafter,
                           100, {"log_loss": 0.5})


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "controller.json"
    save_controller_file({"layerskip": _model(), "ngram": _model("ngram", NGRAM_SIGNALS)}, path)
    return path


def test_round_trip(saved):
    loaded = load_controller_file(saved)
    assert loaded.entries["layerskip"] == _model()
    assert loaded.model_for("ngram", NGRAM_SIGNALS) == _model("ngram", NGRAM_SIGNALS)
    assert not list(saved.parent.glob("*.tmp"))


def test_feature_row_follows_the_names():
    row = feature_row((0.9, 0.3), 2, ctx(context_len=1024, max_context=4096, kv="int4"))
    assert dict(zip(feature_names(MODEL_SIGNALS), row)) == {
        "top1": 0.9, "entropy": 0.3, "position": 3.0, "kv_int8": 0.0, "kv_int4": 1.0, "kv_window": 0.0}
    assert feature_names(NGRAM_SIGNALS)[-len(CONTEXT_FEATURES):] == CONTEXT_FEATURES


def test_the_shipped_file_loads_and_serves_every_drafter():
    shipped = load_controller_file()
    assert DEFAULT_FILE.exists()
    for drafter, signals in (("ngram", NGRAM_SIGNALS), ("layerskip", MODEL_SIGNALS), ("draft", MODEL_SIGNALS)):
        model = shipped.model_for(drafter, signals)
        assert model.models and model.samples > 0 and model.validation
        p = model.predict(feature_row(tuple(1.0 for _ in signals), 0, ctx()))
        assert 0.0 < p < 1.0
    # Without records of its own, the draft model uses layerskip's fit (same signals): the file says so.
    assert shipped.entries["draft"].fitted_on_drafter == "layerskip"


def _rewrite(path, change):
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def test_a_truncated_file_fails_clearly(saved):
    saved.write_text(saved.read_text()[:-40])
    with pytest.raises(ControllerFileError, match=r"is not valid JSON \(truncated or corrupt\?\)"):
        load_controller_file(saved)


def test_an_edited_weight_fails_the_checksum(saved):
    _rewrite(saved, lambda d: d["entries"]["layerskip"]["weights"].__setitem__(0, 5.0))
    with pytest.raises(ControllerFileError, match="checksum mismatch.*damaged or edited"):
        load_controller_file(saved)


def test_a_missing_checksum_fails(saved):
    _rewrite(saved, lambda d: d.pop("checksum"))
    with pytest.raises(ControllerFileError, match="checksum mismatch"):
        load_controller_file(saved)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(schema_version=2), "has schema version 2; this specdecode reads version 1"),
    (lambda d: d.update(format="something"), "is not a specdecode controller file"),
    (lambda d: d.pop("entries"), "has no \"entries\" object"),
])
def test_another_version_or_format_fails(saved, change, message):
    _rewrite(saved, change)
    with pytest.raises(ControllerFileError, match=message):
        load_controller_file(saved)


def _resign(path, change):
    """Changes the entries and writes a valid checksum, as a newer or buggy writer would."""
    doc = json.loads(path.read_text())
    change(doc["entries"])
    doc["checksum"] = checksum({k: doc[k] for k in ("format", "schema_version", "entries")})
    path.write_text(json.dumps(doc))


def test_a_model_fitted_on_other_signals_is_refused_for_the_drafter(saved):
    file = load_controller_file(saved)
    with pytest.raises(ControllerFileError, match=r"'layerskip' model was fitted on features \['top1'.*but this "
                                                  r"version's layerskip drafter gives \['match_len'"):
        file.model_for("layerskip", NGRAM_SIGNALS)
    with pytest.raises(ControllerFileError, match=r"has no model for drafter 'draft' \(it has: layerskip, ngram\)"):
        file.model_for("draft", MODEL_SIGNALS)
    # The same checks when an engine is built: confidence needs the model, adaptive refuses a mismatched one.
    with pytest.raises(ControllerFileError, match="no model for drafter 'draft'"):
        controller_factory("confidence", 8, "draft", MODEL_SIGNALS, str(saved))
    with pytest.raises(ControllerFileError, match="was fitted on features"):
        controller_factory("adaptive", 8, "layerskip", NGRAM_SIGNALS, str(saved))
    assert controller_factory("adaptive", 8, "draft", MODEL_SIGNALS, str(saved))().acceptance is None


@pytest.mark.parametrize("change, message", [
    (lambda e: e["ngram"].update(features=["a", "b"]), "do not end with this version's context features"),
    (lambda e: e["ngram"]["weights"].pop(), "6 weights for 7 features"),
    (lambda e: e["ngram"].update(bias="x"), "bias must be a finite number"),
    (lambda e: e["ngram"].pop("weights"), "lacks weights"),
])
def test_malformed_entries_fail_clearly(saved, change, message):
    _resign(saved, change)
    with pytest.raises(ControllerFileError, match=message):
        load_controller_file(saved)


def test_an_unreadable_file_fails_clearly(tmp_path):
    with pytest.raises(ControllerFileError, match="cannot read controller file"):
        load_controller_file(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="unknown gamma controller 'bogus'"):
        controller_factory("bogus", 8)
