"""argparse value types and flag groups shared by the ``specdecode`` subcommands (each error names the bad value)."""

from __future__ import annotations

import argparse

from specdecode.control import GAMMA_POLICIES
from specdecode.kv.cache import KV_DTYPES, CacheConfig


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


def weight_formats(value: str) -> tuple[str, ...]:
    """A comma list of weight formats (``bench --weights auto,bf16,q4_1``), each one of WEIGHT_FORMATS."""
    from specdecode.models.weights import WEIGHT_FORMATS

    out = tuple(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
    bad = [v for v in out if v not in WEIGHT_FORMATS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(WEIGHT_FORMATS)}, got {value!r}")
    return out


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


def add_kv_arguments(p: argparse.ArgumentParser) -> None:
    """The KV cache flags shared by ``generate`` and ``bench``."""
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto",
                   help="target KV cache: auto (the model's dtype), bfloat16, float32, or int8/int4 (verified tokens "
                        "quantized group-wise; recent ones stay full precision)")
    p.add_argument("--draft-kv-dtype", choices=KV_DTYPES, default="auto", help="the draft model's KV cache, as --kv-dtype")
    p.add_argument("--kv-window", type=positive_int, default=None,
                   help="keep only the last N verified tokens (plus sinks and unverified ones): flat memory")
    p.add_argument("--kv-sinks", type=nonnegative_int, default=0, help="with --kv-window: also keep the first S tokens")
    p.add_argument("--kv-budget", type=byte_size, default=None,
                   help="bytes all KV caches and prefix caches may hold, e.g. 512M; a request that cannot fit fails")
    p.add_argument("--prefix-cache", type=on_off, default=False, metavar="on|off",
                   help="reuse the K/V of prompt prefixes seen in earlier requests (default off)")


# CacheConfig's fields as the KV flags name them, so that its own checks speak the command line's language.
_KV_FLAGS = {"CacheConfig.window": "--kv-window", "CacheConfig.sinks": "--kv-sinks", "CacheConfig.budget": "--kv-budget"}


def cache_configs(args: argparse.Namespace, draft: bool) -> tuple[CacheConfig, CacheConfig]:
    """Target and draft cache settings from the KV flags, checked (by ``CacheConfig``) before anything is loaded.

    Args:
        args: parsed flags (see :func:`add_kv_arguments`).
        draft: whether a draft model will be used (``--draft-kv-dtype`` needs one).

    Raises:
        ValueError: a contradictory combination, naming the flags.
    """
    if args.draft_kv_dtype != "auto" and not draft:
        raise ValueError("--draft-kv-dtype is only used with a draft model (--draft-model) or an eagle head")
    common = dict(window=args.kv_window, sinks=args.kv_sinks, budget=args.kv_budget, prefix_cache=args.prefix_cache)
    configs = []
    for flag, kv_dtype in (("--kv-dtype", args.kv_dtype), ("--draft-kv-dtype", args.draft_kv_dtype)):
        try:
            configs.append(CacheConfig(kv_dtype=kv_dtype, **common))
        except ValueError as exc:
            message = str(exc)
            for field, name in _KV_FLAGS.items():
                message = message.replace(field, name)
            raise ValueError((f"{flag} {kv_dtype}: " if kv_dtype != "auto" else "") + message) from None
    return configs[0], configs[1]
