"""The decode loop: draft -> verify (one target forward) -> commit -> stats.

Plain decoding is the same loop with gamma 0, so the speculative and the plain paths share every line
that computes the target's numbers. The engine owns the target's KV cache; drafters only propose.
It does not load models, parse command lines or batch several requests.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Iterator, Sequence

import torch

from specdecode.batch.sequence import Output, Request, Sequence as RequestState, eos_ids, prompt_ids, stop_strings
from specdecode.control import GAMMA_POLICIES, StepContext, StepRecord, controller_factory
from specdecode.drafters.base import Draft, Drafter
from specdecode.kv.cache import Cache, CacheConfig
from specdecode.kv.memory import KVMemory
from specdecode.kv.prefill import prefill
from specdecode.models.transformer import Transformer
from specdecode.sampling import SamplingParams
from specdecode.stats import RequestStats
from specdecode.timing import interleaved_timings
from specdecode.verify import Pending, Verdict, verify_batch

MAX_GAMMA = 64
SEEDED_GAMMA = 16  # longest draft whose verification ``Engine.seed_costs`` times
# Row counts tried when tuning a forward's padding (see Engine.tune_rows).
MAX_PADDED_ROWS = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """How far to speculate.

    Args:
        gamma: tokens drafted per step (0 = speculation off), or the name of a controller in GAMMA_POLICIES
            (default ``adaptive``: in ``specdecode bench`` it beat the best fixed gamma with a draft model,
            with self-speculation and with n-gram lookup; see BENCHMARKS.md).
        gamma_max: upper bound for controllers.
        controller_file: the acceptance models of the ``confidence`` and ``adaptive`` controllers
            (written by ``specdecode fit-controller``); None = the file shipped with the package.
    """

    gamma: int | str = "adaptive"
    gamma_max: int = 8
    controller_file: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.gamma, str):
            if self.gamma not in GAMMA_POLICIES:
                raise ValueError(f"SpeculativeConfig.gamma={self.gamma!r}: expected an integer 0..{MAX_GAMMA} "
                                 f"or one of {GAMMA_POLICIES}")
        elif not 0 <= self.gamma <= MAX_GAMMA:
            raise ValueError(f"SpeculativeConfig.gamma must be in 0..{MAX_GAMMA}, got {self.gamma}")
        if not 1 <= self.gamma_max <= MAX_GAMMA:
            raise ValueError(f"SpeculativeConfig.gamma_max must be in 1..{MAX_GAMMA}, got {self.gamma_max}")

    @property
    def max_draft(self) -> int:
        """The most tokens a single step may draft."""
        return self.gamma if isinstance(self.gamma, int) else self.gamma_max


@dataclass
class GenerationResult:
    """One finished request.

    Args:
        text: the generated text (stop string and end-of-sequence token excluded).
        token_ids: generated token ids, up to and including the token that ended generation (an
            end-of-sequence token or the token completing a stop string): the same with or without
            speculation.
        finish_reason: "eos", "stop" (a stop string) or "length" (max_new_tokens).
        stats: counters and timings.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: RequestStats = field(default_factory=RequestStats)


def _synchronize(device: torch.device) -> None:
    """Waits for the work queued on a GPU, so that a timer around it sees it (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kv_setting(cache: CacheConfig, dtype: torch.dtype) -> str:
    """A target cache's storage as the controllers see it: "int8", "int4", "window" or a dtype."""
    if cache.kv_dtype in ("int8", "int4"):
        return cache.kv_dtype
    if cache.window is not None:
        return "window"
    return cache.kv_dtype if cache.kv_dtype != "auto" else str(dtype).removeprefix("torch.")


def keep_rows(cache: Cache, slot: int, held: int, verdict: Verdict) -> list[int]:
    """Rolls a slot back to the fed token and the accepted drafts, which a forward wrote as rows from ``held``
    on; returns the kept rows' offsets from ``held`` (a tree's path moved into place by ``Cache.compact``)."""
    if verdict.path is None:
        cache.trim(slot, held + 1 + verdict.accepted)
        return list(range(verdict.accepted + 1))
    rows = [0] + [1 + node for node in verdict.path]
    cache.compact(slot, held, rows)
    return rows


class TextStream:
    """Iterates over text pieces as they are generated; ``result`` is set once iteration ends.

    The pieces are the sequence's showable text (``Sequence.output``): an incomplete UTF-8 character, and
    a tail that could still grow into a stop string, are held back until they are settled.
    """

    def __init__(self, outputs: Iterator[Output]) -> None:
        self._outputs = outputs
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        while True:
            try:
                out = next(self._outputs)
            except StopIteration as done:
                self.result = done.value
                return
            if out.text:
                yield out.text


class Engine:
    """Serves one request at a time with speculative decoding.

    Args:
        target: the model whose output distribution is reproduced exactly.
        tokenizer: turns text into ids and back (needed for text prompts, stop strings and text output).
        drafter: proposes tokens; None means plain decoding.
        spec: gamma policy.
        on_step: called with every step's record (draft signals included), e.g. to gather training data
            for the ``confidence`` controller.
        cache: KV cache settings (dtype, window, sinks, budget, prefix cache); its size is set per request.
    """

    def __init__(self, target: Transformer, tokenizer=None, drafter: Drafter | None = None,
                 spec: SpeculativeConfig = SpeculativeConfig(),
                 on_step: Callable[[StepRecord], None] | None = None, cache: CacheConfig = CacheConfig()) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.spec = spec if drafter is not None else SpeculativeConfig(gamma=0)
        self.on_step = on_step
        self._new_controller = controller_factory(
            self.spec.gamma, self.spec.gamma_max, drafter.name if drafter is not None else None,
            drafter.signal_names if drafter is not None else (), self.spec.controller_file)
        self.cache_config = cache
        self.memory = KVMemory(cache.budget, cache.prefix_cache)  # target + draft caches, prefix caches
        self.cache: Cache | None = None
        self._step_s: dict[int, float] = {}  # decode-step seconds by context length bucket
        # Off our kernels a one-row forward rounds differently from a multi-row one (Backend.row_invariant),
        # so there every forward gets at least two rows.
        self._min_rows = 1 if target.backend.row_invariant else 2
        self._padded_rows: dict[int, int] = {}  # rows needed -> rows run (tune_rows); default: _min_rows
        # Target layers whose features the drafter reads (trained heads), handed over through its observe().
        self._features: tuple[int, ...] = tuple(drafter.feature_layers) if drafter is not None else ()

    def warmup(self) -> None:
        """Runs a short dummy request (prefill, drafting, verification) so that one-time costs such as
        buffer allocation and kernel selection stay out of the next request's timings, then tunes the
        row padding (:meth:`tune_rows`) unless the target runs on our kernels, whose cost only grows
        with the row count (tuning there picks timing noise: seen padding 2-4 rows to 5 on SmolLM2), and
        times the verification curve for the cost-aware controllers (:meth:`seed_costs`)."""
        self.generate([0] * 8, max_new_tokens=8, eos_token_ids=())
        if not self.target.backend.row_invariant:
            self.tune_rows()
        self.seed_costs()

    def seed_costs(self, repeats: int = 5) -> None:
        """Gives the controllers that weigh costs (``cost``, ``adaptive``) the verification curve v(k),
        k = 0..gamma_max, timed now rather than learnt from the k that happen to run; what earlier
        requests taught about drafting is dropped. Each k is timed ``repeats`` times, the k interleaved
        so that drift touches all alike, and its fastest time kept: noise only ever adds time, and one
        slow sample would otherwise price a draft length out (the curve is made non-decreasing, so a
        spike at k carries to every longer draft). Needs a context (``warmup`` has one).
        """
        if not self._new_controller.uses_costs:
            return
        top = min(self.spec.gamma_max, SEEDED_GAMMA, self.cache.stable_rows(0) - 1)
        # Past SEEDED_GAMMA the curve is extrapolated (long drafts are rare; timing is not).
        times = interleaved_timings(self.verify_seconds, range(top + 1), repeats)
        self._new_controller.seed_costs([min(seen) for seen in times])

    @torch.inference_mode()
    def tune_rows(self, repeats: int = 5, margin: float = 0.03) -> dict[int, int]:
        """Times target forwards of up to MAX_PADDED_ROWS rows and pads each forward to the fastest row
        count at or above what it needs (the padding rows, copies of the last token, are ignored).

        oneDNN's bf16 kernels pick their algorithm by row count, and some counts run slower than larger
        ones (measured: 2 rows cost 1.5x what 4 rows cost on Qwen2.5-1.5B, 1.08x on SmolLM2), so a plain
        decode step or a short verification is cheaper padded. A larger count is taken only when it is
        ``margin`` faster. Needs a context in the cache (run a request first; ``warmup`` does).

        Returns:
            Rows needed -> rows run, for 1..MAX_PADDED_ROWS.
        """
        held = self.cache.lengths[0]

        def forward(rows: int) -> float:
            start = time.perf_counter()
            self.target(torch.zeros(1, rows, dtype=torch.long, device=self.target.device), self.cache,
                        invariant_rows=True)
            _synchronize(self.target.device)
            seconds = time.perf_counter() - start
            self.cache.trim(0, held)
            return seconds
        sizes = range(self._min_rows, MAX_PADDED_ROWS + 1)
        # The median: a row count is chosen by comparing typical costs, not best cases.
        cost = {r: statistics.median(t) for r, t in zip(sizes, interleaved_timings(forward, sizes, repeats))}
        padded = {}
        for need in range(1, MAX_PADDED_ROWS + 1):
            best = max(need, self._min_rows)
            for r in range(best + 1, MAX_PADDED_ROWS + 1):
                if cost[r] < cost[best] * (1 - margin):
                    best = r
            padded[need] = best
        self._padded_rows = padded
        self._step_s.clear()  # measured with the old padding: measure again
        self._step_cost()
        return padded

    def generate(self, prompt: str | Sequence[int], sampling: SamplingParams = SamplingParams(),
                 max_new_tokens: int = 128, stop: str | Iterable[str] = (),
                 eos_token_ids: Iterable[int] | None = None) -> GenerationResult:
        """Generates a continuation of ``prompt``; see :meth:`stream` for the arguments."""
        steps = self._run(prompt, sampling, max_new_tokens, stop_strings(stop, self.tokenizer), eos_token_ids)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def stream(self, prompt: str | Sequence[int], sampling: SamplingParams = SamplingParams(),
               max_new_tokens: int = 128, stop: str | Iterable[str] = (),
               eos_token_ids: Iterable[int] | None = None) -> TextStream:
        """Like :meth:`generate`, but yields text as it is accepted.

        Args:
            prompt: text (tokenized without special tokens) or token ids.
            sampling: temperature / top-k / top-p / seed.
            max_new_tokens: generation budget (>= 1).
            stop: a string or strings that end generation: generation stops at the token that completes
                one (as plain decoding would), and the text is cut before it.
            eos_token_ids: ids that end generation; default: the tokenizer's end-of-sequence ids.
        """
        stop = stop_strings(stop, self.tokenizer)
        return TextStream(self._run(prompt, sampling, max_new_tokens, stop, eos_token_ids))

    def _prepare(self, prompt: str | Sequence[int], max_new_tokens: int) -> list[int]:
        ids = prompt_ids(prompt, self.tokenizer, self.target.config.vocab_size,
                         self.target.config.max_position_embeddings, max_new_tokens)
        # Room for the prompt, the budget, and one step's drafted lookahead beyond it.
        need = len(ids) + max_new_tokens + max(self.spec.max_draft, MAX_PADDED_ROWS) + 1
        if self.cache is None or self.cache.max_len < need:
            config = replace(self.cache_config, max_len=-(-need // 256) * 256)
            self.cache = self.memory.new_cache("target", self.target, config)
        self.cache.reset(0)
        return ids

    @torch.inference_mode()
    def _run(self, prompt, sampling: SamplingParams, max_new_tokens: int, stop: tuple[str, ...],
             eos_token_ids) -> Iterator[Output]:
        prompt_ids = self._prepare(prompt, max_new_tokens)
        eos = eos_ids(eos_token_ids, self.tokenizer)
        # The request's state and end rules (EOS, stop strings, budget), as the batch engine keeps them.
        seq = RequestState(Request(tuple(prompt_ids), sampling, max_new_tokens, stop, eos), self.tokenizer)
        stats = seq.stats
        seed = sampling.request_seed()
        generator = sampling.generator(self.target.device, seed)  # on the device that samples
        controller = self._new_controller()
        limit = self.target.config.max_position_embeddings
        kv = kv_setting(self.cache_config, self.target.dtype)

        def timed_stop(position: int, signal: tuple[float, ...]) -> bool:
            tick = time.perf_counter()
            done = controller.stop(position, signal)
            stats.control_s += time.perf_counter() - tick
            return done

        start = time.perf_counter()
        prefix = self.memory.prefix_for(self.target, self.cache.config)
        if self.drafter is not None:
            self.drafter.reset(self.cache, prompt_ids, self.memory)
        observe = self.drafter.observe if self._features else None  # drafters that read the target's features
        stats.prefix_hit_tokens = prefill(self.cache, 0, prompt_ids[:-1], self.target, prefix, self._features,
                                          observe, invariant_rows=self.target.backend.row_invariant)
        _synchronize(self.target.device)
        stats.prefill_s = time.perf_counter() - start
        while not seq.finished:
            remaining = seq.remaining
            tick = time.perf_counter()
            ctx = StepContext(remaining, len(seq.tokens), limit, self._cache_fill(), kv)
            # Drafting past the budget is wasted work: the extra tokens would be cut anyway. Nor may a step
            # reach past the cache's next compression step (it would show later rows an older cache state).
            k = min(controller.next_gamma(ctx), remaining - 1, self.cache.stable_rows(0) - 1)
            t0 = time.perf_counter()
            stats.control_s += t0 - tick
            # Signals are computed only for a controller that stops early, or for the step records.
            watch = timed_stop if controller.early_stop or self.on_step is not None else None
            draft = self.drafter.propose(seq.tokens, k, sampling, generator, watch).check(k, self.drafter.name) \
                if k > 0 else Draft([])
            t1 = time.perf_counter()
            verdict = self._verify(seq.tokens, draft, sampling, generator, seed, observe)
            t2 = time.perf_counter()
            self.cache.commit(0, self.cache.lengths[0])  # the fed token and the accepted drafts are verified
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            # Cut at EOS, at the token that completes a stop string, or at the budget: where plain decoding stops.
            kept = seq.append(verdict.tokens)
            if self.drafter is not None:
                self.drafter.commit(seq.tokens)
            record = StepRecord(ctx, k, len(draft.tokens), verdict.accepted, t1 - t0, t2 - t1, draft.signals)
            tick = time.perf_counter()
            controller.update(record)
            stats.control_s += time.perf_counter() - tick
            if self.on_step is not None:
                self.on_step(record)
            stats.record_step(len(draft.tokens), verdict.accepted, len(kept), draft.tree_depth)
            if seq.finished:
                stats.wall_s = time.perf_counter() - start
                stats.kv_bytes, stats.kv_bytes_per_token = self.memory.usage("target")
                stats.draft_kv_bytes, stats.draft_kv_bytes_per_token = self.memory.usage("draft")
                stats.decode_step_s = self._step_cost()
            yield seq.output(kept)
        return GenerationResult(seq.text, list(seq.generated), seq.finish_reason, stats)

    def _verify(self, seq: list[int], draft: Draft, sampling: SamplingParams, generator: torch.Generator | None,
                seed: int = 0, observe: Callable[[int, torch.Tensor], None] | None = None) -> Verdict:
        """One target forward over [last token, d_1..d_k], acceptance, and cache rollback; ``observe``
        (a drafter's) is handed the kept rows' features."""
        held = self.cache.lengths[0]  # == len(seq) - 1: every token but the last is cached
        k = len(draft.tokens)
        # At least _min_rows rows per forward, so that greedy speculation reproduces plain decoding
        # bitwise. Filler rows (copies of the last token, also used to reach a faster row count) come
        # after the real ones, so no real row sees them; they are ignored and rolled back.
        rows = seq[-1:] + draft.tokens
        want = max(min(self._padded_rows.get(len(rows), self._min_rows), self.cache.stable_rows(0)), len(rows),
                   self._min_rows)
        filler = want - len(rows)
        parents = draft.row_parents()
        if parents is not None:
            parents += range(len(rows) - 1, want - 1)  # filler rows follow the last row
        rows += seq[-1:] * filler
        features = self._features if observe is not None else ()
        out = self.target.forward_rows(torch.tensor(rows, device=self.target.device), self.cache, (0,), (want,),
                                       features=features, parents=None if parents is None else [parents])
        logits, hidden = out.logits, out.features  # [want, V], [want, F] or None
        verdict = verify_batch(logits[:k + 1], [k + 1],  # [k + 1, V]
                               [Pending(draft.tokens, draft.q, sampling, seed, len(seq), generator, draft.parents)])[0]
        # Keep the last token and the accepted drafts (a tree's path, moved into place); the emitted target token
        # is fed next step.
        kept = keep_rows(self.cache, 0, held, verdict)
        if hidden is not None:
            observe(held, hidden[kept])
        return verdict

    def _cache_fill(self) -> float | None:
        """Share of the KV memory budget held by cached tokens and prefixes (None without a budget)."""
        if self.memory.budget is None:
            return None
        held = sum(c.bytes_used() for c in self.memory.caches.values()) + self.memory.prefix_bytes
        return held / self.memory.budget

    def _step_cost(self, repeats: int = 3) -> float:
        """Seconds of one plain decode step (median) at about this request's final context length.

        Measured after the request, then rolled back, so it never affects the request's own timings or
        output; cached per power-of-two context length, since attention cost grows with the context.
        """
        bucket = self.cache.lengths[0].bit_length()
        if bucket not in self._step_s:
            self._step_s[bucket] = statistics.median(self.verify_seconds(0) for _ in range(repeats))
        return self._step_s[bucket]

    @torch.inference_mode()
    def verify_seconds(self, k: int) -> float:
        """Seconds of one verification of ``k`` drafted tokens (0: a plain decode step) at the current
        context, rolled back afterwards so that it never changes what the engine generates next."""
        if self.cache is None or self.cache.lengths[0] == 0:
            raise RuntimeError("verify_seconds needs a context: run a request first")
        held = self.cache.lengths[0]
        start = time.perf_counter()
        self._verify([0], Draft([0] * k), SamplingParams(), None)
        seconds = time.perf_counter() - start
        self.cache.trim(0, held)
        return seconds

    def memory_bytes(self) -> dict[str, int]:
        """What this configuration holds: target and draft weights, and their KV caches."""
        own_cache = self.drafter.own_cache if self.drafter is not None else None
        return {"target_weights": self.target.weight_nbytes,
                "target_kv": self.cache.nbytes if self.cache is not None else 0,
                "draft_weights": self.drafter.weight_nbytes if self.drafter is not None else 0,
                "draft_kv": own_cache.nbytes if own_cache is not None else 0}
