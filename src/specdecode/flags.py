"""The flag groups several ``specdecode`` subcommands share (the model, the drafter, the KV cache), the value
types that know the project's vocabulary (gammas, weight formats), and the typed configs built from them.

This is the one place where those flags become configs (:func:`target_config`, :func:`drafter_config`,
:func:`cache_configs`); what runs afterwards takes the configs, never the parsed flags. It loads nothing.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from specdecode.argtypes import byte_size, ngram_sizes, nonnegative_int, on_off, positive_int
from specdecode.control import GAMMA_POLICIES
from specdecode.drafter_setup import FLAG_FIELDS, PLAIN, DrafterConfig
from specdecode.drafters import TREE_WIDTH, registry
from specdecode.kv.cache import KV_DTYPES, CacheConfig
from specdecode.models.build import DEVICES, DRAFT_QUANT, DRAFT_WEIGHTS
from specdecode.models.backends import LINEAR_CHOICES
from specdecode.models.registry import DEFAULT_MODEL
from specdecode.models.weights import WEIGHT_FORMATS
from specdecode.target import TargetConfig


def weight_formats(value: str) -> tuple[str, ...]:
    """A comma list of weight formats (``bench --weights auto,bf16,q4_1``), each one of WEIGHT_FORMATS."""
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


WEIGHTS_HELP = ("the projections' weight format: auto = a GGUF's own formats as stored (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
                "Q4_K, Q5_K, Q6_K) where our kernels run, else bf16 (default); blocks = as auto with K-quants in "
                "32-weight blocks (Q4_K -> q4_1, Q5_K and Q6_K -> q8_0: cheaper verification rows); bf16; q8_0, q4_0, "
                "q4_1 (llama.cpp's blocks, kept quantized, int8 activations; the output head stays >= q8_0 under q4); "
                "q4_1+head = q4_1 with the output head in q4_1 too (a draft model's default); q4_0+head the same in "
                "q4_0")


def add_model_arguments(p: argparse.ArgumentParser, device: bool = True, weights_list: bool = False,
                        threads_default: str = "torch's choice") -> None:
    """The target's flags: ``--model --dtype --threads --linear --weights`` and, with ``device``, ``--device``;
    ``weights_list``: ``--weights`` takes a comma list (``bench``); ``threads_default`` says what no
    ``--threads`` means."""
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"registry name, .gguf path, HF folder or hub id (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="weights and activations; auto = bf16 where one of our kernels runs (x86-64 with AVX2+FMA) or the GPU supports it, else fp32")
    p.add_argument("--threads", type=positive_int, default=None,
                   help=f"torch intra-op threads, our kernels' too (default: {threads_default})")
    p.add_argument("--linear", choices=LINEAR_CHOICES, default="auto",
                   help="kernel path for the bf16 projections: ours, compiled once: tiled (AVX512-BF16), avx512 "
                        "(AVX512F), avx2 (AVX2+FMA); onednn; torch (F.linear; the only one on a GPU); auto = "
                        "$SPECDECODE_LINEAR if set, else the first of those that runs here (default)")
    if weights_list:
        p.add_argument("--weights", type=weight_formats, default=("auto",), metavar="FORMATS",
                       help=WEIGHTS_HELP.replace("the projections' weight format", "comma list of the target's weight "
                                                 "formats, each run as its own set of methods (method@format)"))
    else:
        p.add_argument("--weights", choices=WEIGHT_FORMATS, default="auto", help=WEIGHTS_HELP)
    if device:
        p.add_argument("--device", choices=DEVICES, default="auto",
                       help="where the models run: auto = cuda when torch sees a GPU, else cpu (default)")


def target_config(args: argparse.Namespace) -> TargetConfig:
    """The target from :func:`add_model_arguments`' flags (with ``--device`` and one weight format)."""
    return TargetConfig(args.model, args.dtype, args.device, args.linear, args.weights)


def _users(flag: str) -> str:
    return "|".join(registry.names_where(lambda spec: flag in spec.flags))


# DrafterConfig's defaults, by field: the drafter flags' defaults, never spelled out here.
_DEFAULTS = {f.name: f.default for f in fields(DrafterConfig)}


def _default(flag: str) -> Any:
    return _DEFAULTS[FLAG_FIELDS[flag]]


def add_drafter_arguments(p: argparse.ArgumentParser) -> None:
    """The drafter flags of ``generate`` and ``serve``: plain decoding, every registered drafter, and the flags
    drafters read, with DrafterConfig's defaults."""
    listing = "; ".join(f"{s.name} = {s.summary}" for s in map(registry.spec, registry.names()))
    p.add_argument("--drafter", choices=(PLAIN, *registry.names()), default=None,
                   help=f"how to draft: {PLAIN} = plain decoding, no drafts; {listing} (default: draft when "
                        f"--draft-model is given, else {_DEFAULTS['kind']})")
    p.add_argument("--draft-model", default=_default("--draft-model"),
                   help=f"draft model for --drafter {_users('--draft-model')} (same vocabulary as --model); auto = "
                        "the registered draft of a registered --model")
    p.add_argument("--draft-quant", choices=DRAFT_QUANT, default=_default("--draft-quant"),
                   help="int8 = int8 weight-only draft model (torch's kernel, any path): cheaper drafts, output still "
                        f"exact (default {_default('--draft-quant')}; on our kernels --draft-weights q8_0 is faster)")
    p.add_argument("--draft-weights", choices=DRAFT_WEIGHTS, default=_default("--draft-weights"),
                   help=f"the draft model's weight format, as --weights is the target's; "
                        f"{_default('--draft-weights')} (default) = q4_1+head on our kernels (a draft's format "
                        "changes acceptance, never the output), else auto")
    p.add_argument("--head", default=_default("--head"), metavar="FILE",
                   help=f"head file for --drafter {_users('--head')} (default: the head shipped for --model, if any)")
    p.add_argument("--draft-vocab", type=int, default=_default("--draft-vocab"), metavar="N",
                   help=f"--drafter {_users('--draft-vocab')}: draft over the N most frequent tokens (0 = all; "
                        "default: a head's as trained; a draft model's end-of-sequence ids and first 32768 ids, "
                        "widened by each request's own tokens, and all for a request whose prompt has more than a "
                        "quarter of its tokens outside them: cheaper drafts where the text is English or code)")
    p.add_argument("--ngram", type=ngram_sizes, default=_default("--ngram"),
                   help=f"--drafter {_users('--ngram')}: min,max n-gram sizes to look up (default "
                        f"{','.join(map(str, _default('--ngram')))})")
    p.add_argument("--tree-width", type=positive_int, default=_default("--tree-width"), metavar="W",
                   help=f"--drafter {_users('--tree-width')}: children per expanded node (default {TREE_WIDTH})")
    p.add_argument("--skip-layers", default=_default("--skip-layers"),
                   help=f"--drafter {_users('--skip-layers')}: the layers to skip, e.g. '4,6,8-12'; 'auto' uses (or "
                        f"runs) the stored calibration (default {_default('--skip-layers')})")
    p.add_argument("--suffix-cache-requests", type=positive_int, default=_default("--suffix-cache-requests"),
                   metavar="N", help=f"--drafter {_users('--suffix-cache-requests')}: finished requests' outputs "
                                     "kept to draft from (the oldest go first; default "
                                     f"{_default('--suffix-cache-requests')})")
    p.add_argument("--suffix-cache-mb", type=positive_int, default=_default("--suffix-cache-mb"), metavar="MB",
                   help=f"--drafter {_users('--suffix-cache-mb')}: most memory those outputs' suffix trie holds "
                        f"(default {_default('--suffix-cache-mb')})")
    p.add_argument("--no-suffix-cache", dest="suffix_cache", action="store_false",
                   default=_default("--no-suffix-cache"),
                   help=f"--drafter {_users('--no-suffix-cache')}: draft from each request's prompt and output only")


def add_gamma_arguments(p: argparse.ArgumentParser) -> None:
    """How far to draft: the fixed draft length or controller of ``generate`` and ``serve``."""
    p.add_argument("--gamma", type=gamma, default="adaptive",
                   help=f"tokens drafted per step (0 = off) or a controller: {', '.join(GAMMA_POLICIES)} (default adaptive)")
    p.add_argument("--gamma-max", type=positive_int, default=8, help="upper bound of the controllers")
    p.add_argument("--long-max", type=nonnegative_int, default=64,
                   help="longest draft from a long, trusted source (a request's prediction, a long suffix match), "
                        "which may pass --gamma-max; 0 = never past it (default 64)")
    p.add_argument("--controller-file", default=None, metavar="FILE",
                   help="acceptance models for --gamma confidence|adaptive (from fit-controller; default: the shipped one)")


def drafter_config(args: argparse.Namespace) -> DrafterConfig:
    """The drafter :func:`add_drafter_arguments`' flags ask for; contradictory flags raise ValueError here,
    before anything is loaded."""
    kind = args.drafter or ("draft" if args.draft_model else _DEFAULTS["kind"])
    return DrafterConfig(kind, **{name: getattr(args, name) for name in FLAG_FIELDS.values()})


def add_kv_arguments(p: argparse.ArgumentParser, prefix_cache: bool = False) -> None:
    """The KV cache flags shared by ``generate``, ``serve`` and ``bench``; ``prefix_cache``: its default (on for a
    server, whose conversations come back with their history; off where each run should start cold)."""
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto",
                   help="target KV cache: auto (the model's dtype), bfloat16, float32, or int8/int4 (verified tokens "
                        "quantized group-wise; recent ones stay full precision)")
    p.add_argument("--draft-kv-dtype", choices=KV_DTYPES, default="auto", help="the draft model's KV cache, as --kv-dtype")
    p.add_argument("--kv-window", type=positive_int, default=None,
                   help="keep only the last N verified tokens (plus sinks and unverified ones): flat memory")
    p.add_argument("--kv-sinks", type=nonnegative_int, default=0, help="with --kv-window: also keep the first S tokens")
    p.add_argument("--kv-budget", type=byte_size, default=None,
                   help="bytes all KV caches and prefix caches may hold, e.g. 512M; a request that cannot fit fails")
    p.add_argument("--prefix-cache", type=on_off, default=prefix_cache, metavar="on|off",
                   help="reuse the K/V of prompt prefixes seen in earlier requests, least recently used out when full "
                        f"(default {'on' if prefix_cache else 'off'})")


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
