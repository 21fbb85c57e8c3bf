"""Fitting the acceptance model: a known logistic relation is recovered from synthetic step records."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from specdecode.cli import main
from specdecode.control.fit import fit_controller, fit_logistic
from specdecode.control.model_file import load_controller_file
from specdecode.control.records import record_json
from specdecode.drafters.base import MODEL_SIGNALS
from control_helpers import ctx, record

# The true relation: logit = -1 + 4 * top1 - 0.8 * entropy - 0.1 * position (the kv setting plays no part).
TRUE = {"top1": 4.0, "entropy": -0.8, "position": -0.1}
TRUE_BIAS = -1.0


def _synthetic(steps: int, seed: int = 0, drafter: str = "layerskip") -> list[dict]:
    rng = random.Random(seed)
    lines = []
    for i in range(steps):
        signals = [(rng.random(), 3 * rng.random()) for _ in range(8)]
        context = ctx(context_len=rng.randrange(50, 4000), max_context=4096)
        accepted = 0
        for position, (top1, entropy) in enumerate(signals):
            z = TRUE_BIAS + TRUE["top1"] * top1 + TRUE["entropy"] * entropy + TRUE["position"] * (position + 1)
            if rng.random() >= 1 / (1 + math.exp(-z)):
                break
            accepted += 1
        lines.append(record_json(record(8, accepted, signals=signals, context=context), MODEL_SIGNALS, model="synthetic",
                                 method=f"{drafter}:g8", drafter=drafter, prompt_id=f"p{i // 20}", repeat=0, step=i % 20))
    return lines


def test_fit_logistic_recovers_weights_and_ignores_constant_columns():
    rng = np.random.default_rng(0)
    x = np.hstack([rng.normal(size=(20000, 2)), np.ones((20000, 1))])
    y = (rng.random(20000) < 1 / (1 + np.exp(-(0.5 + 2 * x[:, 0] - x[:, 1])))).astype(float)
    w, b = fit_logistic(x, y, l2=0.1)
    assert w == pytest.approx([2.0, -1.0, 0.0], abs=0.1)
    assert b == pytest.approx(0.5, abs=0.1)


def test_fit_controller_recovers_a_known_relation():
    (name, model), = fit_controller(_synthetic(4000), l2=0.1).items()
    assert name == "layerskip" and model.models == ("synthetic",)
    weights = dict(zip(model.features, model.weights))
    for feature, want in TRUE.items():
        assert weights[feature] == pytest.approx(want, abs=0.25 if feature != "position" else 0.06), feature
    assert weights["kv_int8"] == weights["kv_int4"] == weights["kv_window"] == 0.0  # never seen: no weight
    assert model.bias == pytest.approx(TRUE_BIAS, abs=0.3)
    v = model.validation
    assert v["samples"] > 1000 and v["log_loss"] < 0.65 and v["accuracy"] > 0.6


def test_fit_controller_aliases_and_errors():
    entries = fit_controller(_synthetic(300), aliases={"draft": "layerskip"})
    assert entries["draft"].drafter == "draft" and entries["draft"].fitted_on_drafter == "layerskip"
    assert entries["draft"].weights == entries["layerskip"].weights
    with pytest.raises(ValueError, match="alias draft=ngram: no records of drafter 'ngram'"):
        fit_controller(_synthetic(50), aliases={"draft": "ngram"})
    no_signals = [dict(line, signals=[]) for line in _synthetic(10)]
    with pytest.raises(ValueError, match="hold no drafted tokens with signals"):
        fit_controller(no_signals)
    all_rejected = [dict(line, accepted=0) for line in _synthetic(10)]
    with pytest.raises(ValueError, match="all 10 recorded tokens were rejected"):
        fit_controller(all_rejected)


def test_fit_controller_command_writes_a_loadable_file(tmp_path, capsys):
    records = tmp_path / "steps.jsonl"
    records.write_text("".join(json.dumps(line) + "\n" for line in _synthetic(400)))
    out = tmp_path / "controller.json"
    assert main(["fit-controller", str(records), "--out", str(out), "--alias", "draft=layerskip"]) == 0
    loaded = load_controller_file(out)
    assert set(loaded.entries) == {"draft", "layerskip"}
    err = capsys.readouterr().err
    assert "layerskip: " in err and "held-out log loss" in err and "draft (the layerskip fit)" in err
    assert main(["fit-controller", str(records), "--out", str(out), "--alias", "draft"]) == 2
    assert "--alias 'draft': expected DRAFTER=FROM" in capsys.readouterr().err
    records.write_text('{"version": 1}\n')
    assert main(["fit-controller", str(records), "--out", str(out)]) == 2
    assert f"{records}:1:" in capsys.readouterr().err


def test_fit_controller_merge_keeps_the_other_drafters_models(tmp_path, capsys):
    records = tmp_path / "steps.jsonl"
    records.write_text("".join(json.dumps(line) + "\n" for line in _synthetic(300, drafter="eagle")))
    out = tmp_path / "controller.json"
    shipped = load_controller_file()
    assert main(["fit-controller", str(records), "--out", str(out), "--merge", str(shipped.path)]) == 0
    merged = load_controller_file(out)
    assert set(merged.entries) == set(shipped.entries) | {"eagle"}
    assert merged.entries["ngram"].to_json() == shipped.entries["ngram"].to_json()
    assert "kept " in capsys.readouterr().err
