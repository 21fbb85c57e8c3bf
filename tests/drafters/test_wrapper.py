"""drafters/base.py's DrafterWrapper: every part of the drafter protocol but ``propose`` reaches the wrapped
drafter, and with nothing wrapped each says what a drafter with nothing of its own says."""

from __future__ import annotations

import torch

from specdecode.drafters.base import Draft, DrafterBase, DrafterWrapper
from specdecode.kv.cache import Cache


class _Recorder(DrafterBase):
    name = "inner"
    signal_names = ("p",)
    feature_layers = (3,)

    def __init__(self) -> None:
        self.calls: list[str] = []

    @property
    def weight_nbytes(self) -> int:
        return 7

    def observe(self, position, features):
        self.calls.append("observe")

    def reset(self, target_cache, prompt=(), memory=None, slot=0):
        self.calls.append(f"reset {list(prompt)} {slot}")

    def propose(self, seq, k, sampling, generator, stop=None):
        return Draft([1] * k)

    def commit(self, seq):
        self.calls.append(f"commit {seq}")

    def long_run(self):
        return 5

    def finish(self, seq):
        self.calls.append("finish")

    def learned(self):
        return 2, 64


class _Wrapper(DrafterWrapper):
    alone_name = "wrapper"

    def __init__(self, inner) -> None:
        self.wrapped = inner


def test_every_part_but_propose_reaches_the_wrapped_drafter():
    inner = _Recorder()
    wrapper = _Wrapper(inner)
    assert (wrapper.name, wrapper.signal_names, wrapper.feature_layers, wrapper.weight_nbytes) == \
        ("inner", ("p",), (3,), 7)
    wrapper.reset(Cache.__new__(Cache), [4, 5], None, slot=2)
    wrapper.observe(0, torch.zeros(1, 1))
    wrapper.commit([4, 5, 6])
    wrapper.finish([4, 5, 6])
    assert inner.calls == ["reset [4, 5] 2", "observe", "commit [4, 5, 6]", "finish"]
    assert wrapper.long_run() == 5 and wrapper.learned() == (2, 64) and wrapper.own_cache is None


def test_with_nothing_wrapped_it_has_nothing_of_its_own():
    wrapper = _Wrapper(None)
    wrapper.reset(Cache.__new__(Cache), [1])
    wrapper.commit([1, 2])
    wrapper.finish([1, 2])
    assert (wrapper.name, wrapper.signal_names, wrapper.feature_layers, wrapper.weight_nbytes, wrapper.own_cache) == \
        ("wrapper", (), (), 0, None)
    assert wrapper.long_run() == 0 and wrapper.learned() == (0, 0)
