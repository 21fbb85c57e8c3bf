"""argparse value types shared by the ``specdecode`` subcommands; each error names the bad value.

Plain values only (counts, sizes, switches): types that know the project's vocabulary (gammas, weight
formats) and the shared flag groups are ``flags.py``'s.
"""

from __future__ import annotations

import argparse


def _int_at_least(value: str, low: int) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value!r}") from None
    if n < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}")
    return n


def positive_int(value: str) -> int:
    """An integer >= 1."""
    return _int_at_least(value, 1)


def positive_float(value: str) -> float:
    """A number > 0."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return x


def nonnegative_int(value: str) -> int:
    """An integer >= 0."""
    return _int_at_least(value, 0)


def ngram_sizes(value: str) -> tuple[int, int]:
    """'min,max' n-gram sizes with 1 <= min <= max."""
    try:
        lo, hi = (int(x) for x in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'min,max' (two integers), got {value!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= min <= max, got {value!r}")
    return lo, hi


_BYTE_UNITS = {"": 1, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30, "t": 2 ** 40}


def byte_size(value: str) -> int:
    """A byte count: '1000000', '512M', '1.5G', '64KiB' (K/M/G/T are powers of 1024; a trailing B or iB is allowed)."""
    text = value.strip().lower().removesuffix("b").removesuffix("i")
    number, unit = (text[:-1], text[-1]) if text and text[-1] in _BYTE_UNITS else (text, "")
    try:
        n = float(number) * _BYTE_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a byte count like 1000000, 512M or 2G, got {value!r}") from None
    if not 1 <= n < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite count of at least 1 byte, got {value!r}")
    return int(n)


def on_off(value: str) -> bool:
    """'on' or 'off'."""
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected 'on' or 'off', got {value!r}")
    return value == "on"
