"""interleaved_timings: order of the calls and what is kept."""

from __future__ import annotations

from specdecode.timing import interleaved_timings


def test_sizes_are_interleaved_forward_then_backward_and_the_warmup_sweep_is_dropped():
    calls = []

    def run(size: int) -> float:
        calls.append(size)
        return float(len(calls))

    times = interleaved_timings(run, [1, 5, 9], repeats=2, warmup=True)
    assert calls == [1, 5, 9, 9, 5, 1, 1, 5, 9]
    assert times == [[6.0, 7.0], [5.0, 8.0], [4.0, 9.0]]  # the first sweep (calls 1-3) is not kept
