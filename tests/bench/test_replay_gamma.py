"""benchmarks/replay_gamma.py: a replay takes exactly the steps the engine takes, and judges them by the record's costs."""

from __future__ import annotations

import pytest

from specdecode.drafters import NgramDrafter
from specdecode.drafters.auto import AutoDrafter
from specdecode.drafters.suffix import SUFFIX_SIGNALS
from specdecode.engine import Engine, SpeculativeConfig
from repo_scripts import load_script
from tiny_models import varied_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [("rep-1", "repetitive", [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9]),
           ("rep-2", "repetitive", [50, 51, 50, 51, 52, 50, 51, 50, 51, 52, 50, 51]),
           ("open-1", "open", [1, 2, 3, 4, 5])]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def replay_gamma():
    return load_script("benchmarks/replay_gamma.py")


@pytest.fixture(scope="module")
def target():
    return varied_model(0)


@pytest.fixture(scope="module")
def recorded(replay_gamma, target):
    return replay_gamma.record(Engine(target), NgramDrafter(), PROMPTS, NEW_TOKENS, gamma_max=6, repeats=1)


def test_record_holds_outputs_proposals_and_costs(recorded, target):
    assert recorded["drafter"] == "ngram" and recorded["v"][0] == 1.0 and len(recorded["v"]) == 7
    for (pid, _, ids), row in zip(PROMPTS, recorded["prompts"]):
        assert row["output"] == Engine(target).generate(ids, max_new_tokens=NEW_TOKENS).token_ids
        assert len(row["proposals"]) == len(row["output"])
        assert all(len(p["tokens"]) == len(p["signals"]) <= 6 for p in row["proposals"])
    assert any(p["tokens"] for row in recorded["prompts"] for p in row["proposals"])


def test_a_learning_drafter_records_its_proposals_too(replay_gamma, target):
    # auto (suffix tries and prompt lookup) learns as the record goes: its proposals and signals are recorded alike.
    data = replay_gamma.record(Engine(target), AutoDrafter(), PROMPTS, NEW_TOKENS, gamma_max=6, repeats=1)
    assert data["drafter"] == "auto" and data["signal_names"] == list(SUFFIX_SIGNALS)
    proposals = [p for row in data["prompts"] for p in row["proposals"]]
    assert all(len(p["tokens"]) == len(p["signals"]) <= 6 for p in proposals)
    assert any(p["tokens"] for p in proposals)
    data = {**data, "v": [1.0 + 0.04 * k for k in range(len(data["v"]))]}  # a fixed curve, as below
    assert replay_gamma.replay(data, [4, "adaptive"], draft_cost=0.0)["4"]["repetitive"] > 1.2


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_a_fixed_gamma_replays_the_engines_own_steps(replay_gamma, recorded, target, gamma):
    make = replay_gamma.controller_factory(gamma, 6)
    engine = Engine(target, drafter=NgramDrafter(), spec=SpeculativeConfig(gamma=gamma))
    for (_, _, ids), row in zip(PROMPTS, recorded["prompts"]):
        steps = engine.generate(ids, max_new_tokens=NEW_TOKENS).stats.target_forwards
        assert replay_gamma.replay_prompt(row, make, recorded["v"], recorded["draft_cost"])[1] == steps


def test_speedups_follow_the_recorded_costs(replay_gamma, recorded):
    # A fixed verification curve, not this machine's timing of a tiny model (which varies by kernel path).
    recorded = {**recorded, "v": [1.0 + 0.04 * k for k in range(len(recorded["v"]))]}
    free = replay_gamma.replay(recorded, [0, 4, "adaptive"], draft_cost=0.0)
    assert free["0"] == {"overall": 1.0, "repetitive": 1.0, "open": 1.0}  # plain decoding against itself
    assert free["4"]["repetitive"] > 1.2
    costly = replay_gamma.replay(recorded, [4, "adaptive"], draft_cost=2.0)
    assert costly["4"]["repetitive"] < free["4"]["repetitive"]
    assert costly["adaptive"]["overall"] > costly["4"]["overall"]  # drafts costing 2 steps each: stay off


def test_replay_refuses_a_file_that_is_not_a_record(replay_gamma, tmp_path, capsys):
    with pytest.raises(ValueError, match="not a replay record"):
        replay_gamma.replay({"format": "specdecode-controller"}, [4])
    foreign = tmp_path / "controller.json"
    foreign.write_text('{"format": "specdecode-controller"}')
    for path in (foreign, tmp_path / "missing.json"):
        with pytest.raises(SystemExit) as exit_:
            replay_gamma.main(["replay", str(path)])
        assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "not a replay record" in err and "missing.json" in err
