"""benchmarks/step_parts.py: a batch's steps timed by part, by wrapping the engine's own phases (restored after), and
the greedy pick swapped for torch's argmax for an A/B."""

from __future__ import annotations

import pytest
import torch

from repo_scripts import load_script
from specdecode import verify
from specdecode.batch.executor import BatchEngine
from specdecode.batch.forward import StepForward
from specdecode.batch.proposing import Proposer
from specdecode.batch.scheduler import SchedulerConfig
from specdecode.sampling import argmax_ids
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def parts():
    return load_script("benchmarks/step_parts.py")


def test_every_part_of_every_step_is_timed_and_the_engine_is_left_as_it_was(parts):
    engine = BatchEngine(tiny_model(), scheduler=SchedulerConfig(max_running=2), max_len=64)
    timer, phases = parts.PartTimer(), (Proposer.plan, StepForward.run, BatchEngine._settle)
    with timer.installed():
        results = engine.run([dict(prompt=[1, 2, 3], max_new_tokens=5), dict(prompt=[4, 5], max_new_tokens=3)])
    seen = timer.take()
    assert (Proposer.plan, StepForward.run, BatchEngine._settle) == phases
    assert sum(len(r.token_ids) for r in results) == 8
    # plain decoding: a row per running sequence a step, each row a token (5 + 3), as long as the longer answer
    assert seen["steps"] == 5 and seen["rows"] == 8
    assert all(seen[part] > 0 for part in parts.PARTS)
    assert seen["forward"] > seen["plan"]
    assert timer.take()["steps"] == 0  # taken: counts start again


def test_the_greedy_pick_is_swapped_for_argmax_and_put_back(parts):
    logits = torch.tensor([[0.0, 2.0, 2.0], [1.0, 0.0, 1.0]])
    with parts.greedy_pick(use_argmax=True):
        assert verify.argmax_ids is not argmax_ids
        assert verify.argmax_ids(logits).tolist() == [1, 0]
    assert verify.argmax_ids is argmax_ids
    with parts.greedy_pick(use_argmax=False):
        assert verify.argmax_ids is argmax_ids
