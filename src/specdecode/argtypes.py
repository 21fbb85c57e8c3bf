"""argparse value types shared by the ``specdecode`` subcommands (each error names the bad value)."""

from __future__ import annotations

import argparse

from specdecode.control import GAMMA_POLICIES


def positive_int(value: str) -> int:
    """An integer >= 1."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def nonnegative_int(value: str) -> int:
    """An integer >= 0."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def gamma(value: str) -> int | str:
    """A fixed gamma (an integer >= 0; 0 = speculation off) or a controller name from GAMMA_POLICIES."""
    if value in GAMMA_POLICIES:
        return value
    try:
        g = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or one of {', '.join(GAMMA_POLICIES)}, "
                                         f"got {value!r}") from None
    if g < 0:
        raise argparse.ArgumentTypeError(f"gamma must be >= 0, got {g}")
    return g


def ngram_sizes(value: str) -> tuple[int, int]:
    """'min,max' n-gram sizes with 1 <= min <= max."""
    try:
        lo, hi = (int(x) for x in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'min,max' (two integers), got {value!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= min <= max, got {value!r}")
    return lo, hi
