"""Runs every method on every prompt in one process: loading, warm-up, interleaving, timing, identity.

Order is what makes side-by-side ratios fair on a noisy machine: for each prompt (and repeat) every
method runs once, the order alternating between forward and reverse, after one untimed warm-up call
per method on the longest prompt with the full budget (it also allocates each engine's largest cache).
This module does not aggregate or format (see ``report.py``).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TextIO

import torch

from specdecode.control import GAMMA_POLICIES
from specdecode.control.config import MAX_GAMMA
from specdecode.control.records import record_json
from specdecode.bench.llamacpp_tools import PeerMissing
from specdecode.bench.methods import (DRAFT_MODEL_FAMILIES, DRAFT_MODEL_USERS, FAMILIES, OUR_FAMILIES,
                                      PREDICTION_FAMILY, SERVER_PEERS, Method, Output, build_hf_model, dtype_name,
                                      engine_method, hf_method, llamacpp_available, llamacpp_method, llamacpp_server_method, method_name,
                                      plain_of)
from specdecode.bench.costs import CostCurve, measure_cost_curve
from specdecode.drafter_setup import PLAIN
from specdecode.drafters import TREE_WIDTH, Needs, registry
from specdecode.drafters.auto import AUTO
from specdecode.drafters.draft_model import check_draft_pair
from specdecode.heads import shipped_head
from specdecode.kv.cache import CacheConfig
from specdecode.models.build import (CHEAPEST, DRAFT_WEIGHTS, LoadedModel, check_weights, cpu_has_fast_bf16,
                                     draft_format, from_checkpoint, resolve_dtype)
from specdecode.models.loader import load_checkpoint
from specdecode.models.native import cpu_flags, cpu_model
from specdecode.models.backends import INT8, resolve_backend
from specdecode.models.weights import WEIGHT_FORMATS
from specdecode.progress import ProgressBar
from specdecode.prompts import Prompt, render
from specdecode.sampling import SamplingParams

Log = Callable[[str], None]
# The x86 features that decide which kernels run and how fast (recorded with every result).
RELEVANT_CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                      "amx_bf16", "amx_int8", "avx_vnni")


@dataclass(frozen=True)
class BenchConfig:
    """What to run.

    Args:
        model: target source (registry name, .gguf, HF folder, hub id).
        draft_model: draft source for ``draft`` and ``hf-assisted``, or None.
        families: method families to run (``none`` is always added: it is the reference).
        gammas: draft lengths and controller names (GAMMA_POLICIES).
        max_new_tokens: the budget of every method.
        temperature: 0 = greedy (identity check on); > 0 samples with seed ``seed + prompt index``.
        repeats: timed runs of each method on each prompt.
        dtype: "auto", "bfloat16", "float32" or "float16"; an explicit one applies to our decoder and
            transformers alike, "auto" picks each its own (see ``peer_dtype``).
        seed: base seed.
        skip_layers: "auto" (stored calibration, or calibrate now) or a layer list like "4,6,8-12".
        ngram_sizes: (min, max) n-gram sizes of our ngram drafter (max is also HF lookup's).
        gamma_max: upper bound of the controllers.
        chat: wrap plain prompts in the chat template when the model has one.
        cost_curve: time verification of 0..cost_curve drafted tokens (0: no curve).
        linear: kernel for our decoder's projections (``--linear``, see ``models.build.load_model``).
        draft_quant: "int8" quantizes our draft model's projections (weight-only), "none" keeps them.
        controller_file: acceptance models of the confidence and adaptive controllers (None: shipped).
        record_steps: a JSONL file to write every step of our drafting methods' timed calls to, or None.
        cache: our engine's KV cache settings (the same for every method of ours, ``none`` included).
        draft_cache: the draft model's (and EAGLE head's) KV cache settings.
        heads: head files of the ``eagle`` and ``medusa`` methods by kind; None (or missing) = the one
            shipped for the target, and without one those methods are skipped with a note.
        draft_vocab: the heads' and draft model's draft vocabulary size (0 = all tokens); None = as each head was
            trained, ``draft_model.DRAFT_VOCAB`` for a draft model.
        tree_width: children per expanded node of the draft-tree and eagle-tree methods.
        weights: the target's weight formats (``--weights``); each one runs our methods on its own copy of
            the target, named ``method@format`` when there is more than one, and checked against its own ``none``.
        draft_weights: the draft model's weight format: "cheapest" (``build.draft_format``, as ``generate``'s
            default) or one of WEIGHT_FORMATS.
    """

    model: str
    draft_model: str | None = None
    families: tuple[str, ...] = FAMILIES
    gammas: tuple[int | str, ...] = (1, 2, 4, 8, "agreement")
    max_new_tokens: int = 128
    temperature: float = 0.0
    repeats: int = 1
    dtype: str = "auto"
    seed: int = 0
    skip_layers: str = "auto"
    ngram_sizes: tuple[int, int] = (1, 3)
    gamma_max: int = 8
    chat: bool = True
    cost_curve: int = 16
    linear: str = "auto"
    draft_quant: str = "none"
    controller_file: str | None = None
    record_steps: str | None = None
    cache: CacheConfig = CacheConfig()
    draft_cache: CacheConfig = CacheConfig()
    heads: dict[str, str | None] = field(default_factory=dict)
    draft_vocab: int | None = None
    tree_width: int = TREE_WIDTH
    weights: tuple[str, ...] = ("auto",)
    draft_weights: str = CHEAPEST

    def __post_init__(self) -> None:
        unknown = [f for f in self.families if f not in FAMILIES]
        if unknown:
            raise ValueError(f"--methods: unknown method families {unknown}; expected some of {', '.join(FAMILIES)}")
        if not self.gammas:
            raise ValueError("--gammas: give at least one gamma")
        if self.draft_quant != "none" and not self.draft_model:
            raise ValueError(f"--draft-quant {self.draft_quant} needs --draft-model NAME|PATH")
        if self.draft_weights != CHEAPEST and not self.draft_model:
            raise ValueError(f"--draft-weights {self.draft_weights} needs --draft-model NAME|PATH")
        if self.draft_quant != "none" and self.draft_weights != CHEAPEST:
            raise ValueError("--draft-quant int8 and --draft-weights both set the draft model's weights; give one")
        for g in self.gammas:
            if g not in GAMMA_POLICIES and not (isinstance(g, int) and 1 <= g <= MAX_GAMMA):
                raise ValueError(f"--gammas: {g!r} is not an integer in 1..{MAX_GAMMA} or one of {GAMMA_POLICIES}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")
        if not self.temperature >= 0.0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        bad = [w for w in self.weights if w not in WEIGHT_FORMATS] + \
            [w for w in (self.draft_weights,) if w not in DRAFT_WEIGHTS]
        if bad or not self.weights or len(set(self.weights)) != len(self.weights):
            raise ValueError(f"--weights: expected distinct formats among {', '.join(WEIGHT_FORMATS)}, got "
                             f"{list(self.weights)} (draft {self.draft_weights})")
        needs_draft = [f for f in self.families if f in DRAFT_MODEL_FAMILIES]
        if needs_draft and not self.draft_model:
            raise ValueError(f"--methods {','.join(needs_draft)} need --draft-model NAME|PATH")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def int_gammas(self) -> list[int]:
        return [g for g in self.gammas if isinstance(g, int)]


@dataclass
class Sample:
    """One timed call: method x prompt x repeat."""

    method: str
    prompt_id: str
    category: str
    repeat: int
    tokens: int
    seconds: float
    stats: dict[str, Any] | None
    finish: str
    token_ids: list[int] = field(default_factory=list, repr=False)
    valid: bool | None = None  # the answer follows its prompt's JSON schema (None: the prompt has none)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Mismatch:
    """A greedy speculative output that differs from ``none``'s: a bug in a lossless method."""

    method: str
    prompt_id: str
    repeat: int
    first_difference: int
    expected: list[int]
    got: list[int]


@dataclass
class RunResult:
    """Everything measured, unaggregated."""

    config: BenchConfig
    prompts: list[Prompt]
    prompt_tokens: dict[str, int]
    methods: list[Method]
    samples: list[Sample]
    skipped: list[tuple[str, str]]
    failed: dict[str, str]
    notes: list[str]
    identity_checked: bool
    identity_comparisons: int
    identity_mismatches: list[Mismatch]
    peer_agreement: dict[str, tuple[int, int]]
    rss_mb: dict[str, float]
    peak_rss_mb: float
    rss_after_load_mb: float
    model_source: str
    draft_source: str | None
    torch_dtype: str
    peer_dtype: str
    linear_kernel: str
    load_s: float
    run_s: float
    cost_curves: list[CostCurve] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------
# memory

def _proc_status_mb(key: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    return None


def current_rss_mb() -> float:
    rss = _proc_status_mb("VmRSS")
    return rss if rss is not None else peak_rss_mb()


def peak_rss_mb() -> float:
    """The process's peak resident memory (VmHWM; ru_maxrss where /proc is missing)."""
    hwm = _proc_status_mb("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024.0 * 1024.0) if sys.platform == "darwin" else peak / 1024.0


# ----------------------------------------------------------------------------------------------
# building the methods

def transformers_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


@dataclass
class _Loaded:
    target: LoadedModel  # in the first of config.weights
    targets: dict[str, LoadedModel]  # by --weights value
    draft: LoadedModel | None
    hf_target: Any
    hf_draft: Any
    hf_error: str | None
    torch_dtype: torch.dtype
    peer_dtype: torch.dtype


def peer_dtype(requested: str, ours: torch.dtype) -> torch.dtype:
    """The dtype of the transformers peers.

    Our kernels widen bf16 to fp32 and so run bf16 fast on any AVX2 CPU; transformers computes bf16
    fast only where the CPU multiplies it natively, elsewhere it would be slowed by emulation, which
    is no fair comparison. So under "auto" a peer runs bf16 only there, float32 otherwise.

    Args:
        requested: the ``--dtype`` asked for ("auto" or a dtype name).
        ours: the dtype our decoder runs in; an explicit ``--dtype`` applies to peers too.
    """
    if requested != "auto":
        return ours
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def _load(config: BenchConfig, log: Log) -> _Loaded:
    """Loads the target (and draft) once; our decoder and transformers get the same tensors."""
    torch_dtype = resolve_dtype(config.dtype)
    hf_dtype = peer_dtype(config.dtype, torch_dtype)
    backend = resolve_backend(config.linear, torch_dtype, torch.device("cpu"), log)  # refuse before loading
    draft_weights = draft_format(config.draft_weights, backend) if config.draft_quant == "none" else "auto"
    for weights in (*config.weights, *((draft_weights,) if config.draft_model else ())):
        check_weights(weights, backend)
    wants_hf = transformers_available() and any(f.startswith("hf") for f in config.families)
    hf_error = None

    def load(source: str, role: str, hf: bool, formats: Sequence[str],
             quantize: str = "none") -> tuple[dict[str, LoadedModel], Any]:
        nonlocal hf_error
        log(f"loading {role} {source} ...")
        ckpt = load_checkpoint(source, progress=log)
        ours = {w: from_checkpoint(ckpt, torch_dtype, INT8 if quantize == "int8" else backend, progress=log, weights=w)
                for w in formats}
        peer = None
        if hf and hf_error is None:
            try:
                peer = build_hf_model(ckpt.config, ckpt.tensors, hf_dtype)
            except Exception as exc:  # a peer that cannot be built is reported, not fatal
                hf_error = f"{type(exc).__name__}: {exc}"
        return ours, peer

    targets, hf_target = load(config.model, "target", wants_hf, config.weights)
    draft = hf_draft = None
    if config.draft_model and any(f in DRAFT_MODEL_FAMILIES + DRAFT_MODEL_USERS for f in config.families):
        drafts, hf_draft = load(config.draft_model, "draft model", "hf-assisted" in config.families,
                                (draft_weights,), config.draft_quant)
        draft = drafts[draft_weights]
        check_draft_pair(targets[config.weights[0]], draft)
    return _Loaded(targets[config.weights[0]], targets, draft, hf_target, hf_draft, hf_error, torch_dtype, hf_dtype)


def _skip_layers(config: BenchConfig, target: LoadedModel, log: Log) -> tuple[int, ...]:
    from specdecode.skip_sets import resolve_skip_set

    return resolve_skip_set(target, config.dtype, config.skip_layers, progress=log)


def build_methods(config: BenchConfig, loaded: _Loaded, budget_ctx: int, log: Log, has_predictions: bool = False,
                  has_schemas: bool = False) -> tuple[list[Method], list[tuple[str, str]], dict[str, str], list[str]]:
    """Every method the configuration asks for, in display order; plus skipped ones, failed ones and notes.
    Peers are skipped when prompts ask for JSON schemas (they would answer unconstrained). What failing here
    leaves running (a peer's server) is stopped."""
    built: list[Method] = []
    try:
        return _build_methods(config, loaded, budget_ctx, log, has_predictions, has_schemas, built)
    except BaseException:
        close_methods(built)
        raise


def close_methods(methods: Sequence[Method]) -> None:
    """Releases what each method holds outside this process, each whatever the others do."""
    for method in methods:
        if method.close is not None:
            try:
                method.close()
            except Exception as exc:  # one that cannot stop cleanly does not keep the others running
                print(f"could not stop {method.name}: {exc}", file=sys.stderr)


@dataclass
class _Built:
    """What `build_methods` gathers family by family: the methods, and the families skipped or failed."""

    methods: list[Method]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    def notes(self) -> list[str]:
        """One line per reason a family was skipped."""
        reasons: dict[str, list[str]] = {}
        for name, why in self.skipped:
            reasons.setdefault(why, []).append(name)
        return [f"{why.replace(' is not installed', '')} is not installed: skipped {', '.join(names)}"
                if why.endswith("is not installed") else f"skipped {', '.join(names)}: {why}"
                for why, names in reasons.items()]


def _build_methods(config: BenchConfig, loaded: _Loaded, budget_ctx: int, log: Log, has_predictions: bool,
                   has_schemas: bool, methods: list[Method]
                   ) -> tuple[list[Method], list[tuple[str, str]], dict[str, str], list[str]]:
    built = _Built(methods)
    sampling = SamplingParams(config.temperature)
    for family in (f for f in FAMILIES if f in config.families or f == PLAIN):
        if has_schemas and family not in OUR_FAMILIES:
            built.skipped.append((family, "the prompts ask for JSON schemas, which the peers are not run under here"))
        elif family == PREDICTION_FAMILY:
            _add_prediction(built, config, loaded, sampling, has_predictions)
        elif family in OUR_FAMILIES:
            _add_ours(built, family, config, loaded, sampling, log)
        elif family.startswith("hf"):
            _add_transformers(built, family, config, loaded, sampling)
        elif family in SERVER_PEERS:  # llama.cpp's own server
            _add_server_peer(built, family, config, loaded, sampling, budget_ctx)
        else:
            _add_llamacpp_python(built, family, config, loaded, sampling, budget_ctx)
    return built.methods, built.skipped, built.failed, built.notes()


def _add_prediction(built: _Built, config: BenchConfig, loaded: _Loaded, sampling: SamplingParams,
                    has_predictions: bool) -> None:
    if not has_predictions:
        built.skipped.append((PREDICTION_FAMILY, "no prompt has a prediction (the edit suite has)"))
        return
    for g in config.gammas:  # n-gram lookup where the prediction has nothing, as `serve` does by default
        method = engine_method("ngram", g, loaded.target, sampling, config.max_new_tokens,
                               ngram_sizes=config.ngram_sizes, gamma_max=config.gamma_max,
                               controller_file=config.controller_file, cache=config.cache)
        method.name, method.family, method.predicts = method_name(PREDICTION_FAMILY, g), PREDICTION_FAMILY, True
        built.methods.append(method)


def _add_ours(built: _Built, family: str, config: BenchConfig, loaded: _Loaded, sampling: SamplingParams,
              log: Log) -> None:
    gammas: Sequence[int | str | None] = [None] if family == PLAIN else config.gammas
    skip = head = None
    spec = registry.spec(family) if family != PLAIN else None  # (plain decoding has no drafter)
    if spec is not None and spec.needs & Needs.SKIP_SET:
        skip = _skip_layers(config, loaded.target, log)  # a bad --skip-layers is a usage error
    if spec is not None and spec.needs & Needs.HEAD:
        kind = spec.head_kind
        head = config.heads.get(kind) or shipped_head(loaded.target.model, kind)
        if head is None:
            built.skipped.append((family, f"no {kind} head for this model (train-head, then --{kind}-head FILE)"))
            return
    for weights, model in loaded.targets.items():
        suffix = f"@{weights}" if len(loaded.targets) > 1 else ""
        for g in gammas:
            if spec is not None and spec.tree and g == "confidence":
                built.skipped.append((method_name(family, g) + suffix, "a tree has no per-token signals to stop on"))
                continue
            method = engine_method(family, g, model, sampling, config.max_new_tokens, loaded.draft, skip,
                                   config.ngram_sizes, config.gamma_max, config.controller_file,
                                   record=config.record_steps is not None and family != PLAIN,
                                   cache=config.cache, draft_cache=config.draft_cache, head=head,
                                   draft_vocab=config.draft_vocab, tree_width=config.tree_width)
            method.name += suffix
            method.predicts = family == AUTO  # as a client would send it: auto drafts from a prediction first
            built.methods.append(method)


def _add_transformers(built: _Built, family: str, config: BenchConfig, loaded: _Loaded,
                      sampling: SamplingParams) -> None:
    if not transformers_available():
        built.skipped.append((family, "transformers is not installed"))
        return
    if loaded.hf_error is not None:
        built.failed[family] = loaded.hf_error
        return
    eos = loaded.target.tokenizer.eos_token_ids
    options: dict[str, Any] = {"hf": {}, "hf-assisted": {"assistant": loaded.hf_draft}}.get(family, {
        "lookup_tokens": max(config.int_gammas, default=8), "lookup_ngram": config.ngram_sizes[1]})
    built.methods.append(hf_method(family, loaded.hf_target, eos, sampling, config.max_new_tokens, **options))


def _add_server_peer(built: _Built, family: str, config: BenchConfig, loaded: _Loaded, sampling: SamplingParams,
                     budget_ctx: int) -> None:
    target, draft = loaded.target, loaded.draft
    if not target.source.endswith(".gguf") or (family.endswith("-draft") and not (
            draft and draft.source.endswith(".gguf"))):
        built.skipped.append((family, "needs GGUF models (--model and, drafted, --draft-model NAME or a .gguf path)"))
        return
    try:
        built.methods.append(llamacpp_server_method(family, target.source, sampling, config.max_new_tokens,
                                                    budget_ctx, draft.source if draft else None,
                                                    draft_max=max(config.int_gammas, default=16),
                                                    lookup_ngram=config.ngram_sizes[1]))
    except PeerMissing as exc:
        built.skipped.append((family, str(exc)))
    except RuntimeError as exc:
        built.failed[family] = str(exc)


def _add_llamacpp_python(built: _Built, family: str, config: BenchConfig, loaded: _Loaded,
                         sampling: SamplingParams, budget_ctx: int) -> None:
    if not llamacpp_available():
        built.skipped.append((family, "llama-cpp-python is not installed"))
        return
    target = loaded.target
    if not target.source.endswith(".gguf"):
        built.skipped.append((family, "needs a GGUF model (--model NAME or a .gguf path)"))
        return
    lookup = max(config.int_gammas, default=8) if family.endswith("lookup") else None
    try:
        built.methods.append(llamacpp_method(family, target.source, target.tokenizer.eos_token_ids, sampling,
                                             config.max_new_tokens, budget_ctx, lookup_tokens=lookup))
    except Exception as exc:
        built.failed[family] = f"{type(exc).__name__}: {exc}"


# ----------------------------------------------------------------------------------------------
# the run

def follows(text: str | None, schema: str) -> bool:
    """Whether ``text`` is JSON valid under ``schema`` (a JSON schema's text; checked by ``jsonschema``)."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text or ""), json.loads(schema))
    except (json.JSONDecodeError, jsonschema.ValidationError, jsonschema.SchemaError):
        return False
    return True


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _render_prompts(prompts: list[Prompt], loaded: _Loaded, chat: bool) -> dict[str, list[int]]:
    """Each prompt's token ids, as every method is fed them; refuses prompts that tokenize to nothing or
    to ids outside the target's vocabulary."""
    rendered = {p.id: render(p, loaded.target.tokenizer, chat=chat) for p in prompts}
    empty = [pid for pid, ids in rendered.items() if not ids]
    if empty:
        raise ValueError(f"prompts {empty[:5]} tokenize to nothing")
    vocab = loaded.target.model.config.vocab_size
    bad = [pid for pid, ids in rendered.items() if any(not 0 <= t < vocab for t in ids)]
    if bad:
        raise ValueError(f"prompts {bad[:5]} tokenize to ids outside the model's vocabulary of {vocab}")
    return rendered


class _Calls:
    """Runs methods on prompts: a method that raises is reported (on the bar), recorded in ``failed`` and
    dropped from ``alive``; the process's resident memory is kept per method after each call.

    Args:
        methods: the methods, in display order.
        rendered: each prompt's token ids.
        bar: the progress bar its messages go through.
        failed: method name -> error, shared with the methods that failed to build.
    """

    def __init__(self, methods: list[Method], rendered: dict[str, list[int]], bar: ProgressBar,
                 failed: dict[str, str]) -> None:
        self.alive, self.rendered, self.bar, self.failed = list(methods), rendered, bar, failed
        self.rss: dict[str, float] = {}

    def __call__(self, method: Method, prompt: Prompt, seed: int) -> Output | None:
        try:
            ids = self.rendered[prompt.id]
            asks = {"prediction": prompt.prediction} if method.predicts else {}
            if method.constrains and prompt.schema is not None:
                asks["schema"] = prompt.schema
            out = method.run(ids, seed, **asks)
        except Exception as exc:  # reported, never hidden; the method is dropped from the rest of the run
            self.failed[method.name] = f"{type(exc).__name__}: {exc}"
            self.bar.message(f"!! {method.name} FAILED on {prompt.id}: {self.failed[method.name]}")
            self.alive.remove(method)
            return None
        self.rss[method.name] = max(self.rss.get(method.name, 0.0), current_rss_mb())
        return out


@dataclass
class _Identity:
    """Greedy outputs compared turn by turn: ours against their plain decoding (a mismatch is a bug), peers
    against the first ``none`` (agreement only)."""

    comparisons: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    peer_agreement: dict[str, tuple[int, int]] = field(default_factory=dict)

    def check(self, methods: list[Method], outputs: dict[str, Output], prompt: Prompt, repeat: int,
              bar: ProgressBar) -> None:
        """Compares one turn's ``outputs`` (method name -> output) on ``prompt``."""
        first_plain = next((m.name for m in methods if m.family == PLAIN), PLAIN)
        for method in methods:
            reference = outputs.get(plain_of(method.name) if method.kind == "ours" else first_plain)
            if method.family == PLAIN or method.name not in outputs or reference is None:
                continue
            got, expected = outputs[method.name].token_ids, reference.token_ids
            if method.kind == "ours":
                self.comparisons += 1
                if got != expected:
                    m = Mismatch(method.name, prompt.id, repeat, _first_difference(expected, got), expected, got)
                    self.mismatches.append(m)
                    bar.message(f"!!!! OUTPUT MISMATCH: {method.name} on {prompt.id} (repeat {repeat}) differs from "
                                f"plain decoding at generated token {m.first_difference}: greedy speculative "
                                f"decoding must be token-identical !!!!")
            else:
                same, total = self.peer_agreement.get(method.name, (0, 0))
                self.peer_agreement[method.name] = (same + (got == expected), total + 1)


def _write_steps(records: TextIO, out: Output, method: Method, prompt: Prompt, repeat: int, model: str) -> None:
    """One timed call's step records as JSON lines (``--record-steps``)."""
    for step, record in enumerate(out.steps):
        records.write(json.dumps(record_json(
            record, method.signal_names, model=model, method=method.name, drafter=method.drafter or method.family,
            prompt_id=prompt.id, category=prompt.category, repeat=repeat, step=step)) + "\n")


def _timed_runs(config: BenchConfig, prompts: list[Prompt], methods: list[Method], calls: _Calls,
                identity: _Identity) -> list[Sample]:
    """Every alive method on every prompt and repeat, in alternating order; identity checked per turn."""
    samples: list[Sample] = []
    records = open(config.record_steps, "w") if config.record_steps else None
    try:
        for index, prompt in enumerate(prompts):
            seed = config.seed + index
            for repeat in range(config.repeats):
                turn = index * config.repeats + repeat
                order = list(calls.alive) if turn % 2 == 0 else list(reversed(calls.alive))
                outputs = {}
                for method in order:
                    out = calls(method, prompt, seed)
                    calls.bar.update(f"{method.name} {prompt.id}")
                    if out is None:
                        continue
                    outputs[method.name] = out
                    valid = follows(out.text, prompt.schema) if prompt.schema is not None else None
                    samples.append(Sample(method.name, prompt.id, prompt.category, repeat, len(out.token_ids),
                                          out.seconds, out.stats, out.finish, list(out.token_ids), valid))
                    if records:
                        _write_steps(records, out, method, prompt, repeat, config.model)
                if config.greedy:
                    identity.check(methods, outputs, prompt, repeat, calls.bar)
    finally:
        if records:
            records.close()
    return samples


def run_bench(config: BenchConfig, prompts: list[Prompt], log: Log | None = None,
              progress: bool = True, stream: TextIO | None = None) -> RunResult:
    """Loads, builds the methods, warms up and runs every method on every prompt.

    Args:
        config: what to run.
        prompts: the (already selected) prompts.
        log: one-line status messages (default: stderr).
        progress: draw a progress bar on ``stream``.
        stream: where the progress bar and loud messages go (default: stderr).
    """
    stream = stream if stream is not None else sys.stderr
    log = log or (lambda m: print(m, file=stream, flush=True))
    if not prompts:
        raise ValueError("no prompts to run")
    if any(p.schema for p in prompts):
        try:
            import jsonschema  # noqa: F401  (the answers are checked against their schemas)
        except ImportError:
            raise ValueError("prompts with a JSON schema need jsonschema to check the answers: "
                             "pip install 'specdecode[bench]'") from None
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass

    t_load = time.perf_counter()
    loaded = _load(config, log)
    rendered = _render_prompts(prompts, loaded, config.chat)
    longest = max(prompts, key=lambda p: len(rendered[p.id]))
    budget_ctx = -(-(len(rendered[longest.id]) + config.max_new_tokens + 2 * max(config.int_gammas, default=8) + 16)
                   // 256) * 256
    methods, skipped, failed, notes = build_methods(config, loaded, budget_ctx, log,
                                                    any(p.prediction for p in prompts), any(p.schema for p in prompts))
    try:
        return _run_methods(config, prompts, loaded, rendered, longest, methods, skipped, failed, notes,
                            time.perf_counter() - t_load, log, stream, progress)
    finally:
        close_methods(methods)


def _run_methods(config: BenchConfig, prompts: list[Prompt], loaded: _Loaded, rendered: dict[str, list[int]],
                 longest: Prompt, methods: list[Method], skipped: list, failed: dict[str, str], notes: list[str],
                 load_s: float, log: Log, stream: TextIO, progress: bool) -> RunResult:
    """Warms up and times every method on every prompt (the methods built by ``run_bench``)."""
    rss_after_load = current_rss_mb()
    if not config.greedy:
        notes.append(f"temperature {config.temperature} > 0: outputs are sampled (seed {config.seed} + prompt index), "
                     "so the token-identity check against 'none' is skipped")

    bar = ProgressBar(len(methods) * (1 + len(prompts) * config.repeats), stream, enabled=progress)
    calls = _Calls(methods, rendered, bar, failed)
    t_run = time.perf_counter()
    for method in list(calls.alive):  # warm-up: untimed, longest prompt, full budget
        calls(method, longest, config.seed)
        if method.forget is not None:  # a learner: else that prompt's timed run would draft from its own output
            method.forget()
        bar.update(f"warm-up {method.name}")
    learners = [m.name for m in methods if m.learns]
    if learners and config.repeats > 1:
        notes.append(f"{', '.join(learners)} draft from earlier requests' outputs: repeats after the first see the "
                     "same prompt's earlier output")
    identity = _Identity()
    samples = _timed_runs(config, prompts, methods, calls, identity)
    bar.close()
    run_s = time.perf_counter() - t_run
    curves = []
    if config.cost_curve:
        for model in filter(None, (loaded.target, loaded.draft)):
            log(f"timing verification of 0..{config.cost_curve} drafted tokens on {model.source} ...")
            curves.append(measure_cost_curve(model, rendered[longest.id], config.cost_curve))
    return RunResult(
        config=config, prompts=prompts, prompt_tokens={pid: len(ids) for pid, ids in rendered.items()},
        methods=methods, samples=samples, skipped=skipped, failed=failed, notes=notes,
        identity_checked=config.greedy and any(m.family == PLAIN for m in methods),
        identity_comparisons=identity.comparisons, identity_mismatches=identity.mismatches,
        peer_agreement=identity.peer_agreement, rss_mb=calls.rss, peak_rss_mb=peak_rss_mb(),
        rss_after_load_mb=rss_after_load, model_source=loaded.target.source,
        draft_source=loaded.draft.source if loaded.draft else None, linear_kernel=loaded.target.model.backend.name,
        torch_dtype=dtype_name(loaded.torch_dtype), peer_dtype=dtype_name(loaded.peer_dtype), load_s=load_s,
        run_s=run_s, cost_curves=curves)


def cpu_family(flags: frozenset[str]) -> str:
    """A short label of what the CPU offers our kernels, e.g. "x86-64 AVX512-BF16"."""
    if "avx512_bf16" in flags:
        return "x86-64 AVX512-BF16"
    if "avx512f" in flags:
        return "x86-64 AVX512F (no BF16)"
    if "avx2" in flags:
        return "x86-64 AVX2"
    return platform.machine()


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded with every result."""
    import specdecode

    flags = cpu_flags()
    env: dict[str, Any] = {"specdecode": specdecode.__version__, "python": platform.python_version(),
                           "torch": torch.__version__, "platform": platform.platform(),
                           "cpu_model": cpu_model(), "cpu_family": cpu_family(flags),
                           "cpu_flags": sorted(f for f in RELEVANT_CPU_FLAGS if f in flags),
                           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    for name in ("transformers", "llama_cpp"):
        try:
            module = __import__(name)
            env[name] = getattr(module, "__version__", "unknown")
        except ImportError:
            env[name] = None
    return env
