"""The things a benchmark compares: our engine with each drafter and gamma, and peer implementations.

A :class:`Method` is a name plus a callable ``run(prompt_ids, seed) -> Output``; everything it needs
(models, budget, sampling) is bound when it is built. Peers run on the same weights as our engine:
the transformers models are built from the very checkpoint tensors our decoder is built from (no hub
access), llama.cpp reads the same GGUF file. This module times one call each; it does not loop over
prompts, aggregate or print (see ``runner.py`` and ``report.py``).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from specdecode.control import StepRecord
from specdecode.drafter_setup import PLAIN
from specdecode.drafters import TREE_WIDTH, DrafterInputs, DrafterSpec, Needs, registry
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.grammar import Grammar
from specdecode.kv.cache import CacheConfig
from specdecode.models.build import LoadedModel
from specdecode.models.config import ModelConfig
from specdecode.sampling import SamplingParams

# The n-gram drafter given each prompt's prediction (prompt files' "prediction"; other methods never see it).
PREDICTION_FAMILY = "prediction"
OUR_FAMILIES = (PLAIN, *registry.names(), PREDICTION_FAMILY)  # our engine: plain decoding, then with each drafter
# llama.cpp's own llama-server (``specdecode peers build``): plain, with the draft model, with n-gram lookup.
SERVER_PEERS = ("llamacpp-server", "llamacpp-server-draft", "llamacpp-server-lookup")
PEER_FAMILIES = ("hf", "hf-assisted", "hf-lookup", "llamacpp", "llamacpp-lookup", *SERVER_PEERS)
FAMILIES = OUR_FAMILIES + PEER_FAMILIES
# Families that need a separate draft model (--draft-model).
DRAFT_MODEL_FAMILIES = (*registry.names_where(lambda spec: bool(spec.needs & Needs.DRAFT_MODEL)), "hf-assisted",
                        "llamacpp-server-draft")
# Families that draft with the draft model too when the run has one (``auto``).
DRAFT_MODEL_USERS = registry.names_where(lambda spec: bool(spec.uses & Needs.DRAFT_MODEL))

_HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM")}


@dataclass
class Output:
    """One timed generation.

    Args:
        token_ids: generated ids (an end-of-sequence token that ended generation included).
        seconds: wall time of the whole call (prefill included).
        stats: ``RequestStats.to_dict()`` for our engine, None for peers.
        finish: "eos" or "length" (or our engine's finish reason).
        steps: our engine's step records, when the method records them.
    """

    token_ids: list[int]
    seconds: float
    stats: dict[str, Any] | None = None
    finish: str = ""
    steps: list[StepRecord] = field(default_factory=list)
    text: str | None = None  # the answer's text (ours: what a prompt's schema is checked against)


@dataclass
class Method:
    """One column of the benchmark.

    Args:
        name: e.g. ``none``, ``ngram:g4``, ``ngram:agreement``, ``hf-lookup``.
        family: one of FAMILIES.
        run: ``(prompt_ids, seed) -> Output``; with ``predicts`` also ``prediction=``, with ``constrains`` also
            ``schema=`` (a JSON schema's text the answer must follow).
        gamma: the draft length (int), a controller name, or None for methods that do not draft.
        params: settings worth recording in the JSON (draft sizes, peer options).
        memory: bytes the configuration holds (weights and KV caches by part), for our engine.
        signal_names: names of the drafter's per-token signals in step records (our drafting methods).
        drafter: the drafter's name, its model's in a controller file (our drafting methods; ``auto`` with a draft
            model is ``auto+draft``); None: the family's.
        kernel: what the target's projections ran on: our ``Transformer.backend.name`` (e.g. "tiled",
            "onednn", "int8"), "transformers" or "llama.cpp".
        dtype: the target's parameter dtype ("bfloat16", ...); "gguf" for llama.cpp (the file's own types).
        draft_kernel: the separate draft model's kernel (``draft`` and ``hf-assisted``), else None.
        draft_dtype: the separate draft model's dtype, else None.
        weights: the target's weight formats (``Transformer.weight_format``), "gguf" for llama.cpp.
        weight_bytes: the target's resident weight bytes (ours; packed copies included).
        draft_weights: the separate draft model's weight formats, else None.
        predicts: it is handed each prompt's prediction (the ``prediction`` family).
        constrains: it decodes under each prompt's JSON schema (our engine).
        learns: its drafter keeps what earlier requests generated (``DrafterSpec.learns``), so its timed runs see
            the outputs of the prompts before them (and of earlier repeats).
        forget: drops what its drafter learnt (``BatchEngine.forget_learned``), for a learner (None otherwise).
        close: releases what the method holds outside this process (a peer's server), or None.
    """

    name: str
    family: str
    run: Callable[[list[int], int], Output]
    gamma: int | str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    memory: Callable[[], dict[str, int]] | None = None
    signal_names: tuple[str, ...] = ()
    drafter: str | None = None
    kernel: str | None = None
    dtype: str | None = None
    draft_kernel: str | None = None
    draft_dtype: str | None = None
    weights: str | None = None
    weight_bytes: int | None = None
    draft_weights: str | None = None
    predicts: bool = False
    constrains: bool = False
    learns: bool = False
    forget: Callable[[], None] | None = None
    close: Callable[[], None] | None = None

    @property
    def kind(self) -> str:
        """"ours" or "peer"."""
        return "ours" if self.family in OUR_FAMILIES else "peer"


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the JSON document spells it: "bfloat16" for ``torch.bfloat16``."""
    return str(dtype).replace("torch.", "")


def plain_of(name: str) -> str:
    """The plain-decoding method a method of ours is checked and compared against: ``none``, or in a run of
    several weight formats, the ``none@format`` of its own format."""
    _, at, weights = name.partition("@")
    return f"{PLAIN}@{weights}" if at else PLAIN


def method_name(family: str, gamma: int | str | None) -> str:
    if gamma is None:
        return family
    return f"{family}:{gamma}" if isinstance(gamma, str) else f"{family}:g{gamma}"


def _cut_at_eos(ids: list[int], eos: frozenset[int]) -> list[int]:
    cut = next((i for i, t in enumerate(ids) if t in eos), None)
    return ids if cut is None else ids[:cut + 1]


# ----------------------------------------------------------------------------------------------
# our engine

def engine_method(family: str, gamma: int | str | None, target: LoadedModel, sampling: SamplingParams,
                  max_new_tokens: int, draft_model: LoadedModel | None = None,
                  skip_layers: Sequence[int] | None = None, ngram_sizes: tuple[int, int] | None = None,
                  gamma_max: int = 8, controller_file: str | None = None, record: bool = False,
                  cache: CacheConfig = CacheConfig(), draft_cache: CacheConfig = CacheConfig(),
                  head: str | Path | None = None, draft_vocab: int | None = None,
                  tree_width: int = TREE_WIDTH) -> Method:
    """Our engine with one drafter (or none: ``PLAIN``) and one gamma policy, under one KV cache setting.

    Each method gets its own Engine (own KV cache, prefix cache and drafter state); the target weights are shared.
    Timed from outside ``Engine.generate``: nothing benchmark-specific runs inside the decode loop, except,
    with ``record``, keeping each step's record (which also makes the drafter compute its signals).
    ``ngram_sizes`` None: the n-gram drafters' own.
    """
    drafter_spec = registry.spec(family) if family != PLAIN else None
    drafter = None
    if drafter_spec is not None:
        drafter = registry.build(family, DrafterInputs(
            target=target.model, draft_model=draft_model.model if draft_model else None,
            skip_layers=tuple(skip_layers) if skip_layers else None, ngram_sizes=ngram_sizes, draft_cache=draft_cache,
            head=head, draft_vocab=draft_vocab, eos_ids=tuple(target.tokenizer.eos_token_ids), tree_width=tree_width))
    spec = SpeculativeConfig(gamma if gamma is not None else 0, gamma_max, controller_file)
    steps: list[StepRecord] = []
    engine = Engine(target.model, target.tokenizer, drafter, spec, on_step=steps.append if record else None,
                    cache=cache)
    engine.warmup()  # as `specdecode generate` does: one-time costs out of the timings, row padding tuned

    def run(prompt_ids: list[int], seed: int, prediction: str | None = None, schema: str | None = None) -> Output:
        params = replace(sampling, seed=seed)
        grammar = Grammar.json_schema(schema) if schema is not None else None  # (compiled once: the engine keeps it)
        steps.clear()
        start = time.perf_counter()
        result = engine.generate(prompt_ids, params, max_new_tokens, prediction=prediction, grammar=grammar)
        seconds = time.perf_counter() - start
        return Output(result.token_ids, seconds, result.stats.to_dict(), result.finish_reason, list(steps),
                      result.text)

    learns = drafter_spec is not None and drafter_spec.learns
    uses_draft_model = drafter_spec is not None and (bool(drafter_spec.needs & Needs.DRAFT_MODEL) or
                                                     (draft_model is not None and family in DRAFT_MODEL_USERS))
    draft = draft_model if uses_draft_model else None
    params = _drafter_params(drafter_spec, drafter, skip_layers, draft, head) if drafter_spec is not None else {}
    if isinstance(gamma, str):
        params["gamma_max"] = gamma_max
    if gamma in ("confidence", "adaptive"):
        params["controller_file"] = controller_file
    drafts_with = draft.model if draft is not None else None
    return Method(method_name(family, gamma), family, run, gamma, params, memory=engine.memory_bytes,
                  signal_names=drafter.signal_names if drafter is not None else (),
                  drafter=drafter.name if drafter is not None else None,
                  kernel=target.model.backend.name, dtype=dtype_name(target.model.dtype),
                  draft_kernel=drafts_with.backend.name if drafts_with else None,
                  draft_dtype=dtype_name(drafts_with.dtype) if drafts_with else None,
                  weights=target.model.weight_format, weight_bytes=target.model.weight_nbytes,
                  draft_weights=drafts_with.weight_format if drafts_with else None,
                  learns=learns, forget=engine.batch.forget_learned if learns else None, constrains=True)


def _drafter_params(spec: DrafterSpec, drafter: Any, skip_layers: Sequence[int] | None,
                    draft_model: LoadedModel | None, head: str | Path | None) -> dict[str, Any]:
    """The drafter's settings worth recording in the JSON."""
    params: dict[str, Any] = {}
    if "--ngram" in spec.flags:
        params["ngram_sizes"] = [drafter.min_ngram, drafter.max_ngram]
    if "--tree-width" in spec.flags:
        params["tree_width"] = drafter.tree_width
    if spec.needs & Needs.SKIP_SET:
        params["skip_layers"] = list(skip_layers or ())
    if draft_model is not None:
        params["draft_model"] = draft_model.source
    if head is not None:
        params["head"] = str(head)
    if head is not None or draft_model is not None:
        params["draft_vocab"] = int(drafter.vocab.ids.numel()) if drafter.vocab is not None else 0
    return params


# ----------------------------------------------------------------------------------------------
# transformers peers

def build_hf_model(config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype):
    """A transformers ``*ForCausalLM`` holding the same weights as our decoder.

    Args:
        config: the checkpoint's architecture (``ModelConfig.to_hf()`` becomes the HF config).
        tensors: HF-named float32 tensors from ``models.loader.load_checkpoint``.
        dtype: parameter dtype (``runner.peer_dtype``: our decoder's, or float32 where bf16 is slow here).

    Raises:
        RuntimeError: transformers is missing, or the tensors do not fit its model.
    """
    try:
        import transformers
    except ImportError:
        raise RuntimeError("transformers is not installed (pip install 'specdecode[dev]')") from None
    config_name, class_name = _HF_CLASSES[config.arch]
    hf_config = getattr(transformers, config_name)(**config.to_hf())
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            no_init_weights = contextlib.nullcontext
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in the target dtype: no float32 copy first
    try:
        with warnings.catch_warnings(), no_init_weights():
            warnings.simplefilter("ignore")
            model = getattr(transformers, class_name)(hf_config)
    finally:
        torch.set_default_dtype(previous)
    state = {k: v.to(dtype) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary" not in m and not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"transformers {class_name} does not fit the checkpoint: missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]}")
    if config.tie_word_embeddings:
        model.tie_weights()
        if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
            model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def hf_method(family: str, hf_model, eos_token_ids: frozenset[int], sampling: SamplingParams,
              max_new_tokens: int, assistant=None, lookup_tokens: int | None = None,
              lookup_ngram: int | None = None) -> Method:
    """transformers ``generate``: plain, assisted (``assistant_model``) or prompt lookup.

    Same budget and the same stop tokens as our engine; temperature > 0 samples from the full
    distribution (top-k and top-p off, as ours), seeded per prompt with ``torch.manual_seed``.
    """
    from transformers import GenerationConfig

    eos = sorted(eos_token_ids)
    options: dict[str, Any] = dict(max_new_tokens=max_new_tokens, use_cache=True, num_beams=1,
                                   eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0)
    if sampling.greedy:
        options["do_sample"] = False
    else:
        options.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or 0,
                       top_p=sampling.top_p)
    params: dict[str, Any] = {}
    if lookup_tokens is not None:
        options.update(prompt_lookup_num_tokens=lookup_tokens, max_matching_ngram_size=lookup_ngram or 2)
        params.update(prompt_lookup_num_tokens=lookup_tokens, max_matching_ngram_size=lookup_ngram or 2)
    if assistant is not None:
        gc = assistant.generation_config
        params.update(num_assistant_tokens=gc.num_assistant_tokens or 20,
                      num_assistant_tokens_schedule=gc.num_assistant_tokens_schedule or "constant")
    config = GenerationConfig(**options)
    extra = {"assistant_model": assistant} if assistant is not None else {}
    eos_set = frozenset(eos)

    def run(prompt_ids: list[int], seed: int) -> Output:
        if not sampling.greedy:
            torch.manual_seed(seed)
        start = time.perf_counter()
        ids = torch.tensor([prompt_ids])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                    **extra)
        seconds = time.perf_counter() - start
        tokens = _cut_at_eos(out[0, len(prompt_ids):].tolist(), eos_set)
        finish = "eos" if tokens and tokens[-1] in eos_set else "length"
        return Output(tokens, seconds, None, finish)

    return Method(family, family, run, lookup_tokens if family == "hf-lookup" else None, params,
                  kernel="transformers", dtype=dtype_name(hf_model.dtype),
                  draft_kernel="transformers" if assistant is not None else None,
                  draft_dtype=dtype_name(assistant.dtype) if assistant is not None else None)


# ----------------------------------------------------------------------------------------------
# llama.cpp peers

def llamacpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def llamacpp_method(family: str, gguf_path: str | Path, eos_token_ids: frozenset[int], sampling: SamplingParams,
                    max_new_tokens: int, n_ctx: int, lookup_tokens: int | None = None) -> Method:
    """llama-cpp-python on the same GGUF file: plain, or with its prompt-lookup draft (``LlamaPromptLookupDecoding``).

    Note that llama.cpp computes with the GGUF's quantized weights, while our engine and transformers
    use them dequantized: its greedy output may differ from ours.
    """
    import llama_cpp

    threads = torch.get_num_threads()
    kwargs: dict[str, Any] = dict(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                  verbose=False, seed=0)
    params: dict[str, Any] = {"n_threads": threads}
    if lookup_tokens is not None:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kwargs["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens)
        params["num_pred_tokens"] = lookup_tokens
    llm = llama_cpp.Llama(**kwargs)
    eos = frozenset(eos_token_ids) | {llm.token_eos()}
    temp = 0.0 if sampling.greedy else sampling.temperature

    def run(prompt_ids: list[int], seed: int) -> Output:
        if not sampling.greedy:
            llm.set_seed(seed)
        start = time.perf_counter()
        tokens: list[int] = []
        finish = "length"
        for tok in llm.generate(list(prompt_ids), top_k=sampling.top_k or 0, top_p=sampling.top_p, min_p=0.0,
                                temp=temp, repeat_penalty=1.0, reset=True):
            tokens.append(int(tok))
            if tok in eos:
                finish = "eos"
                break
            if len(tokens) >= max_new_tokens:
                break
        seconds = time.perf_counter() - start
        return Output(tokens, seconds, None, finish)

    return Method(family, family, run, lookup_tokens if family == "llamacpp-lookup" else None, params,
                  kernel="llama.cpp", dtype="gguf", weights="gguf")


def llamacpp_server_method(family: str, gguf_path: str | Path, sampling: SamplingParams, max_new_tokens: int,
                           n_ctx: int, draft_path: str | Path | None = None, draft_max: int = 16,
                           lookup_ngram: int = 3) -> Method:
    """llama.cpp's own llama-server on the same GGUF (``bench/llamacpp_server.py``), one request at a time:
    plain (``llamacpp-server``), drafted by ``draft_path`` (``-draft``) or by n-gram lookup of ``lookup_ngram``
    tokens (``-lookup``), at most ``draft_max`` tokens a step. Its tokens/s is wall time around each HTTP call, as ours is around
    each call; ``close`` stops the server.

    Raises:
        llamacpp_tools.PeerMissing: llama-server is not built here (the message names the build command).
    """
    from specdecode.bench.llamacpp_server import LOOKUP_TYPE, LlamaServer, ServerOptions

    lookup = family.endswith("-lookup")
    options = ServerOptions(Path(gguf_path), torch.get_num_threads(), ctx=n_ctx,
                            draft=Path(draft_path) if family.endswith("-draft") else None, lookup=lookup,
                            draft_max=draft_max, lookup_ngram=lookup_ngram)
    server = LlamaServer(options)

    def run(prompt_ids: list[int], seed: int) -> Output:
        start = time.perf_counter()
        reply = server.complete(prompt_ids, max_new_tokens, sampling, seed)
        seconds = time.perf_counter() - start
        finish = "eos" if reply.get("stop_type") == "eos" else "length"
        return Output([int(t) for t in reply.get("tokens", [])], seconds, None, finish)

    params: dict[str, Any] = {"n_threads": options.threads}
    if options.draft is not None or lookup:
        params.update(draft_max=draft_max, **({"spec_type": LOOKUP_TYPE, "lookup_ngram": lookup_ngram} if lookup else {}))
    return Method(family, family, run, draft_max if (options.draft is not None or lookup) else None, params,
                  kernel="llama.cpp", dtype="gguf", weights="gguf", close=server.close)
