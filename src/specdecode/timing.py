"""Timing several sizes of one operation on a noisy machine: the sizes interleaved, forward then backward,
so that drift (another process, frequency changes) touches all of them alike.

It does not choose what to time or which statistic to keep: callers take the fastest (noise only ever
adds time) or the median of what :func:`interleaved_timings` returns.
"""

from __future__ import annotations

from typing import Callable, Sequence


def interleaved_timings(run: Callable[[int], float], sizes: Sequence[int], repeats: int,
                        warmup: bool = False) -> list[list[float]]:
    """Seconds of ``run(size)`` for every size, ``repeats`` times each.

    Args:
        run: times one call at the given size and returns its seconds.
        sizes: the sizes, e.g. draft lengths 0..K.
        repeats: timings kept per size.
        warmup: run one untimed sweep first.

    Returns:
        Per size (in the order of ``sizes``), its ``repeats`` timings.
    """
    times: list[list[float]] = [[] for _ in sizes]
    for r in range(repeats + warmup):
        order = range(len(sizes)) if r % 2 == 0 else range(len(sizes) - 1, -1, -1)
        for i in order:
            seconds = run(sizes[i])
            if r >= warmup:
                times[i].append(seconds)
    return times
