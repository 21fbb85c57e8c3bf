"""The engine: every step drafts for each running sequence, verifies all drafts in one target forward, and hands
each sequence its tokens. One request (``engine.Engine``) and many (the server) run this same step.

A step is four parts, each a module of its own:
1. admission (``admission.py``): waiting sequences take free KV slots, get their drafter chain and controller,
   and their prompts are prefilled (or read a few rows per step inside the decode forwards);
2. proposing (``proposing.py``): the step's row budget shared between fed tokens, prompt rows and drafts, each
   sequence's controller pricing its draft at the forward it joins, and its drafter chain's draft;
3. the forward (``forward.py``): one row-invariant target forward over every sequence's ragged rows, masked by
   the grammars;
4. acceptance (``acceptance.py``): verification, each slot rolled back to what was kept, log-probabilities, and
   the tokens committed; then records (``records.py``) for the controllers, stats and observer.
Rows are computed as they would be alone, so a request's greedy output is bitwise what it is served alone, and a
sampled one (n-gram drafting or none) depends only on its seed.

Not here: threads (``serve/loop.py`` steps the engine from one thread), HTTP, text streaming (``engine.py``), the
choice of what to run (``scheduler.py``), or timing forwards (``costs.py``).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Callable, Iterable, Iterator, Sequence

import torch

from specdecode.batch.acceptance import Accepted, accept, commit
from specdecode.batch.admission import Admission, slot_drafters
from specdecode.batch.costs import MAX_PADDED_ROWS, WARMUP_CONTEXT, RowPadding, StepTimer
from specdecode.batch.forward import StepForward
from specdecode.batch.observer import StepObserver
from specdecode.batch.proposing import Proposer, StepPlan
from specdecode.batch.records import record_step
from specdecode.batch.scheduler import Scheduler, SchedulerConfig
from specdecode.batch.sequence import (MAX_TOP_LOGPROBS, GenerationResult, Request, SequenceState, eos_ids,
                                       predicted, prompt_ids, stop_strings)
from specdecode.batch.target_kv import CHUNKED_PREFIX_BLOCK, TargetKV, kv_setting
from specdecode.control import controller_factory
from specdecode.control.config import SpeculativeConfig
from specdecode.drafters.base import Drafter
from specdecode.grammar import Grammar, GrammarCompiler
from specdecode.kv.cache import CacheConfig
from specdecode.kv.memory import KVMemory
from specdecode.models.transformer import Transformer
from specdecode.sampling import SamplingParams


class BatchEngine:
    """Serves requests together with per-request speculation.

    Args:
        target: the model whose output distribution is reproduced exactly.
        tokenizer: for text prompts, stop strings and text output.
        new_drafter: makes a drafter (None: plain decoding), called once per KV slot.
        spec: gamma policy; each sequence gets its own controller, sharing the engine's cost estimates.
        cache: KV settings; ``slots`` is taken from the scheduler's ``max_running`` and ``max_len`` per slot
            from ``slot_len``.
        scheduler: how many sequences run and wait.
        max_len: tokens one sequence may hold (prompt + generated); default: the model's context, at most 4,096.
        observer: told of admissions, steps and finished sequences (metrics, step records).
        slot_len: tokens each slot holds at first (default ``max_len``); a request that needs more while the
            engine is idle grows every slot (``Engine`` starts small and grows to its longest request).
        record_signals: have drafters compute every drafted token's signal even when no controller stops
            drafts early (for step records, ``bench --record-steps``).
    """

    def __init__(self, target: Transformer, tokenizer=None, new_drafter: Callable[[], Drafter | None] | None = None,
                 spec: SpeculativeConfig = SpeculativeConfig(), cache: CacheConfig = CacheConfig(),
                 scheduler: SchedulerConfig = SchedulerConfig(), max_len: int | None = None,
                 observer: StepObserver | None = None, slot_len: int | None = None,
                 record_signals: bool = False) -> None:
        drafters = slot_drafters(new_drafter, scheduler.max_running)
        probe = drafters[0] if drafters else None
        self.target, self.tokenizer, self.observer = target, tokenizer, observer
        self.spec = spec if probe is not None else replace(spec, gamma=0)
        context = target.config.max_position_embeddings
        self.max_len = min(context, 4096) if max_len is None else max_len
        if not 1 <= self.max_len <= context:
            raise ValueError(f"max_len must be in 1..{context} (the model's context), got {self.max_len}")
        self._limit_name = "the model's context length" if self.max_len == context else \
            "the engine's max_len per sequence"
        self.scheduler = Scheduler(scheduler)
        # Prompts are prefilled a few rows at a time inside the decode forwards where rows are computed alike in any
        # forward (our kernels) and the cache does not compress (a compressing cache prefills at admission); such
        # prompts reuse prefixes in small blocks, so that a follow-up turn recomputes few of its history's tokens.
        chunked = target.backend.row_invariant and not cache.compressed
        self.memory = KVMemory(cache.budget, cache.prefix_cache)
        self.kv = TargetKV(target=target, memory=self.memory, base=replace(cache, slots=scheduler.max_running),
                           step_rows=max(self.spec.longest_draft, MAX_PADDED_ROWS) + 1,
                           prefix_block=CHUNKED_PREFIX_BLOCK if chunked else None)
        self.kv.allocate(self.max_len if slot_len is None else min(slot_len, self.max_len))
        self.timer = StepTimer(target=target, kv=self.kv, padding=RowPadding(1 if target.backend.row_invariant else 2))
        features = tuple(probe.feature_layers) if probe is not None else ()
        new_controller = controller_factory(self.spec.gamma, self.spec.gamma_max, probe.name if probe else None,
                                            probe.signal_names if probe else (), self.spec.controller_file,
                                            scheduler.max_rows)
        self.admission = Admission(target=target, kv=self.kv, drafters=drafters, new_controller=new_controller,
                                   spec=self.spec, grammars=self.grammar_compiler, timer=self.timer,
                                   scheduler=self.scheduler, tokenizer=tokenizer, chunked=chunked, features=features)
        self.proposer = Proposer(kv=self.kv, limits=scheduler, spec=self.spec, max_len=self.max_len,
                                 kv_kind=kv_setting(cache, target.dtype), record_signals=record_signals)
        self.forward = StepForward(target=target, kv=self.kv, padding=self.timer.padding, features=features)
        self._grammars: GrammarCompiler | None = None  # made at the first request with a grammar
        self._grammars_lock = threading.Lock()

    # ------------------------------------------------------------------ requests

    def submit(self, prompt: str | Sequence[int], sampling: SamplingParams = SamplingParams(),
               max_new_tokens: int = 128, stop: str | Iterable[str] = (), eos_token_ids: Iterable[int] | None = None,
               on_output: Callable[[SequenceState, object], None] | None = None,
               prediction: str | Sequence[int] | None = None, logprobs: int | None = None,
               grammar: Grammar | None = None) -> SequenceState:
        """Queues a request; it starts at a later :meth:`step`. Arguments as for ``Engine.stream``, and
        ``logprobs``: each output carries its tokens' log-probabilities with this many alternatives (``logprobs.py``).

        Raises:
            ValueError: bad input (named; ``grammar.GrammarError`` for a grammar that does not compile).
            QueueFullError: the waiting queue is full.
        """
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS} alternatives per token (got {logprobs})")
        stop = stop_strings(stop, self.tokenizer)
        vocab = self.target.config.vocab_size
        ids = prompt_ids(prompt, self.tokenizer, vocab, self.max_len, max_new_tokens, self._limit_name)
        if grammar is not None:
            self.grammar_compiler().compile(grammar)  # a grammar that does not compile is refused now
        request = Request(prompt_ids=tuple(ids), sampling=sampling, max_new_tokens=max_new_tokens, stop=stop,
                          eos=eos_ids(eos_token_ids, self.tokenizer),
                          prediction=predicted(prediction, self.tokenizer, vocab), logprobs=logprobs, grammar=grammar)
        self.kv.grow_for(len(ids) + max_new_tokens, busy=self.has_work)
        seq = SequenceState(request, self.tokenizer, on_output)
        self.scheduler.add(seq)
        return seq

    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler, made at the first call (building llguidance's view of the vocabulary
        takes 0.2-0.9 s: ``serve`` makes it at start); any thread may call.

        Raises:
            GrammarError: this model's tokenizer cannot be used with a grammar.
            ValueError: the engine has no tokenizer.
        """
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("a grammar needs an engine with a tokenizer")
                self._grammars = GrammarCompiler(self.tokenizer.backend.to_str(), self.target.config.vocab_size,
                                                 self.tokenizer.eos_token_ids)
            return self._grammars

    def cancel(self, seq: SequenceState, reason: str = "cancelled") -> None:
        """Ends a sequence now (from the thread that steps): its slot is free for the next step.

        Args:
            seq: a sequence of this engine; one that already finished is left alone.
            reason: "cancelled" (the client went away) or "error" (the step serving it failed).
        """
        if seq.finished:
            return
        seq.finish(reason)
        self._retire(seq)
        seq.emit([])

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def learned(self) -> tuple[int, int]:
        """(requests, bytes) the drafters keep from finished requests (one store, shared by every slot's)."""
        drafters = self.admission.drafters
        return drafters[0].learned() if drafters else (0, 0)

    def forget_learned(self) -> None:
        """Drops what the drafters learnt from earlier requests (the suffix cache of their outputs, ``auto``'s
        calibration of its sources): later requests draft as on a fresh engine (the controllers' step costs stay).

        Raises:
            RuntimeError: the engine has work (a running request would lose what it drafts from).
        """
        if self.has_work:
            raise RuntimeError("forget_learned needs an idle engine")
        for drafter in self.admission.drafters:
            drafter.forget()

    def run(self, requests: Sequence[dict]) -> list[GenerationResult]:
        """Serves ``requests`` (keyword arguments of :meth:`submit`) together; results in their order."""
        pending, sequences = list(requests), []
        while pending or self.has_work:
            while pending and self.scheduler.can_accept:
                sequences.append(self.submit(**pending.pop(0)))
            self.step()
        return [s.result() for s in sequences]

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self) -> None:
        """Admits waiting sequences, then runs one forward for every running one: prompt rows of those still
        prefilling (oldest first, within the row budget) and [last token, drafts] of those decoding."""
        for seq in self.scheduler.admit():
            self.admission.start(seq)
            if self.observer is not None:
                self.observer.admitted(seq)
        running = [s for s in self.scheduler.running if not s.finished]
        if not running:
            return
        plan = self.proposer.plan(running)
        tick = time.perf_counter()
        result = self.forward.run(running, plan)
        accepted = accept(result, self.kv.cache)
        self.target.synchronize()  # before the timer is read
        verify_s = time.perf_counter() - tick - accepted.logprobs_s
        for seq in running:
            if seq in plan.proposals:
                self._settle(seq, plan, accepted.accepted[seq], verify_s, result.real_rows)

    def _settle(self, seq: SequenceState, plan: StepPlan, outcome: Accepted, verify_s: float, real_rows: int) -> None:
        """Commits a decoding sequence's step, records it, and emits its output (its slot freed first if it
        finished)."""
        if seq in plan.chunk:
            seq.stats.prefill_s = time.perf_counter() - seq.arrival
        kept = commit(seq, outcome.verdict, self.kv.cache)
        proposal = plan.proposals[seq]
        seq.last_rows = 1 + len(proposal.draft.tokens)
        record_step(seq, proposal, outcome.verdict, len(kept), verify_s=verify_s,
                    others_rows=real_rows - seq.last_rows, observer=self.observer)  # its prompt rows too
        if seq.finished:
            self._retire(seq)
        seq.emit(kept, None if outcome.logprobs is None else outcome.logprobs[:len(kept)])

    def _retire(self, seq: SequenceState) -> None:
        self.admission.retire(seq)
        if self.observer is not None:
            self.observer.finished(seq)

    # ------------------------------------------------------------------ costs

    @torch.inference_mode()
    def warmup(self, repeats: int = 5) -> None:
        """Serves a short dummy request, so that one-time costs (buffers, kernel selection) stay out of the first real
        requests, then runs the timings the controllers and stats need (``StepTimer.calibrate``). Call before
        serving."""
        if self.has_work:
            raise RuntimeError("warmup needs an idle engine")
        self.admission.warming = True
        try:
            self.run([dict(prompt=[0] * 16, max_new_tokens=8, eos_token_ids=())])
        finally:
            self.admission.warming = False
        with self.timer.borrowed_slot([0] * WARMUP_CONTEXT, self.scheduler.slots, self.has_work) as slot:
            self.timer.calibrate(slot, self.admission.new_controller, self.scheduler.config.max_rows, repeats)

    @contextmanager
    def verify_timer(self, context: Sequence[int]) -> Iterator[Callable[[int], float]]:
        """While the block runs, a free slot holds ``context`` (prefilled); yields ``seconds(k)``: one
        verification forward of k drafted tokens there, as a step runs it (padding included), rolled back."""
        with self.timer.borrowed_slot(context, self.scheduler.slots, self.has_work) as slot:
            yield lambda k: self.timer.time_rows(slot, k + 1)

    def memory_bytes(self) -> dict[str, int]:
        """What this configuration holds: target and draft weights (shared by the slots' drafters), and the
        KV caches as allocated."""
        drafters = self.admission.drafters
        return {"target_weights": self.target.weight_nbytes, "target_kv": self.kv.cache.nbytes,
                "draft_weights": drafters[0].weight_nbytes if drafters else 0,
                "draft_kv": sum(d.own_cache.nbytes for d in drafters if d.own_cache is not None)}
