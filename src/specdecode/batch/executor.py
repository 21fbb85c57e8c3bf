"""The engine: every step drafts for each running sequence, verifies all drafts in one target forward, and
hands each sequence its tokens. One request (``engine.Engine``) and many (the server) run this same step.

A step is: admit waiting sequences onto free KV slots; share the step's row budget between the
decoding sequences' fed tokens, the prompts still being read (a few rows each step, on our kernels) and
the drafts; draft in turn (who goes first turns each step), each sequence's own controller pricing its
draft at the forward it joins: the fed tokens, prompt rows, the drafts before it and, for those after it,
drafts as long as their last ones; run one row-invariant forward over every sequence's ragged rows
(``rows.py``, ``Transformer.forward_rows``); verify (``verify_batch``), roll each slot back to its
accepted length, commit and emit. Rows are computed as they would be alone, so a request's greedy output
is bitwise what it is served alone, and a sampled one (n-gram drafting or none) depends only on its seed.

Each KV slot has a drafter of its own, reset for every sequence it serves and handed that slot: a draft
model's or EAGLE head's cache is that slot's (named ``draft-<slot>`` in the KV memory), layerskip drafts in
the slot of the target's cache, and drafters that read the target's features (trained heads) get their
sequence's rows of each forward.

Not here: threads (``serve/loop.py`` steps the engine from one thread), HTTP, text streaming
(``engine.py``), or the choice of what to run (``scheduler.py``).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Iterator, Sequence as Seq

import numpy as np
import torch

from specdecode.batch.costs import MAX_PADDED_ROWS, RowPadding, StepCostTable, fastest, remembered_curve
from specdecode.batch.observer import StepObserver
from specdecode.batch.rows import ForwardRows, SequenceRows, lay_out
from specdecode.batch.scheduler import Scheduler, SchedulerConfig
from specdecode.batch.sequence import (MAX_TOP_LOGPROBS, GenerationResult, Output, Request, Sequence, eos_ids,
                                       predicted, prompt_ids, stop_strings)
from specdecode.control import StepContext, StepRecord, controller_factory
from specdecode.control.config import SpeculativeConfig
from specdecode.control.long import LongDrafts
from specdecode.drafters.base import Draft, Drafter, OwnCache, StopRule
from specdecode.drafters.forced import ForcedDrafter, within
from specdecode.drafters.prediction import PredictionDrafter
from specdecode.grammar import Grammar, GrammarCompiler, mask_rows, sole_tokens
from specdecode.kv.cache import Cache, CacheConfig
from specdecode.kv.memory import KVMemory
from specdecode.logprobs import TokenLogprob, token_logprobs, verdict_rows
from specdecode.models.fetch import cache_dir
from specdecode.models.native import cpu_model, source_digest
from specdecode.models.prefill import prefill
from specdecode.models.rows import LogitRows
from specdecode.models.transformer import Transformer
from specdecode.sampling import SamplingParams
from specdecode.timing import interleaved_timings
from specdecode.verify import Pending, Verdict, verify_batch

SEEDED_ROWS = 17  # longest forward timed for the cost curve (a fed token + 16 drafts); longer ones extrapolated
WARMUP_CONTEXT = 64  # tokens of context the warm-up timings run at: projections, which grow with rows, dominate
NO_DRAFT = Draft([])


@dataclass
class StepPlan:
    """What one step runs: prompt rows per prefilling sequence and, per decoding one (in drafting order), its
    draft budget (0 for a plain step) and the context its controller decided in. Drafts are decided in turn
    (``BatchEngine._draft_budget``): ``rows`` counts the forward's rows so far (fed tokens, prompt rows, the
    drafts already proposed), ``expected`` the drafts still to come (as long as those sequences' last ones)
    and ``room`` the draft rows still within the step's budget."""

    chunk: dict[Sequence, int]
    decoding: list[Sequence]
    rows: int
    room: int
    expected: int
    budgets: dict[Sequence, int] = field(default_factory=dict)
    contexts: dict[Sequence, StepContext] = field(default_factory=dict)

    def turn_of(self, seq: Sequence) -> int:
        """Starts ``seq``'s turn; returns the rows the others put in the forward its draft joins (its own
        expected draft leaves ``expected``: it is the one being decided)."""
        self.expected -= seq.last_rows - 1
        return self.rows - 1 + self.expected

    def drafted(self, tokens: int) -> None:
        """Counts a draft just proposed: its rows join the forward and leave the room."""
        self.rows += tokens
        self.room -= tokens


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


def drafter_record(ctx: StepContext, budget: int, draft: Draft, verdict: Verdict, draft_s: float, verify_s: float,
                   others_rows: int) -> StepRecord:
    """A step as its controller learns it: the drafter's own tokens. A grammar's forced tokens lead the draft but
    are not the drafter's choice (counted apart); where one was rejected, the drafter's tokens after it were never
    judged, and none count."""
    forced = draft.forced
    judged = verdict.accepted >= forced and len(draft.tokens) > forced
    return StepRecord(ctx, budget - forced if judged else 0, len(draft.tokens) - forced if judged else 0,
                      verdict.accepted - forced if judged else 0, draft_s, verify_s,
                      draft.signals if judged else (), others_rows, forced, min(verdict.accepted, forced))


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
        probe = new_drafter() if new_drafter is not None else None
        self.target = target
        self.tokenizer = tokenizer
        self.spec = spec if probe is not None else replace(spec, gamma=0)
        # One drafter per slot, reused by the sequences the slot serves; a drafter's own cache is its slot's.
        self._drafters = [probe, *(new_drafter() for _ in range(scheduler.max_running - 1))] if probe else []
        for slot, drafter in enumerate(self._drafters):
            if isinstance(drafter, OwnCache):
                drafter.cache_name = f"draft-{slot}"
        self._features = tuple(probe.feature_layers) if probe is not None else ()
        self._new_controller = controller_factory(
            self.spec.gamma, self.spec.gamma_max, probe.name if probe is not None else None,
            probe.signal_names if probe is not None else (), self.spec.controller_file, scheduler.max_rows)
        context = target.config.max_position_embeddings
        self.max_len = min(context, 4096) if max_len is None else max_len
        if not 1 <= self.max_len <= context:
            raise ValueError(f"max_len must be in 1..{context} (the model's context), got {self.max_len}")
        self._limit_name = "the model's context length" if self.max_len == context else \
            "the engine's max_len per sequence"
        self.scheduler = Scheduler(scheduler)
        self.memory = KVMemory(cache.budget, cache.prefix_cache)
        self._cache_base = replace(cache, slots=scheduler.max_running)
        self._allocate(self.max_len if slot_len is None else min(slot_len, self.max_len))
        self._kv = kv_setting(cache, target.dtype)
        self.padding = RowPadding(1 if target.backend.row_invariant else 2)
        self.step_costs = StepCostTable()
        # Prompts are prefilled a few rows at a time inside the decode forwards where rows are computed alike in
        # any forward (our kernels) and the cache neither compresses nor shares prefixes (those prefill in
        # fixed chunks at admission).
        self._chunked_prefill = target.backend.row_invariant and not cache.compressed and not cache.prefix_cache
        self.observer = observer
        self.record_signals = record_signals
        self._warming = False
        self._steps = 0  # steps run: whose turn it is to draft first
        self._grammars: GrammarCompiler | None = None  # made at the first request with a grammar
        self._grammars_lock = threading.Lock()

    def _allocate(self, tokens: int) -> None:
        """Gives every slot room for ``tokens`` plus one step's drafted (or padding) rows beyond them."""
        room = tokens + max(self.spec.longest_draft, MAX_PADDED_ROWS) + 1
        self.cache_config = replace(self._cache_base, max_len=-(-room // 64) * 64)
        self.cache = self.memory.new_cache("target", self.target, self.cache_config)
        self._prefix = self.memory.prefix_for(self.target, self.cache_config)

    # ------------------------------------------------------------------ requests

    def submit(self, prompt: str | Seq[int], sampling: SamplingParams = SamplingParams(), max_new_tokens: int = 128,
               stop: str | Iterable[str] = (), eos_token_ids: Iterable[int] | None = None,
               on_output: Callable[[Sequence, Output], None] | None = None,
               prediction: str | Seq[int] | None = None, logprobs: int | None = None,
               grammar: Grammar | None = None) -> Sequence:
        """Queues a request; it starts at a later :meth:`step`. Arguments as for ``Engine.stream``, and
        ``logprobs``: each output carries its tokens' log-probabilities with this many alternatives (``logprobs.py``).

        Raises:
            ValueError: bad input (named; ``grammar.GrammarError`` for a grammar that does not compile).
            QueueFullError: the waiting queue is full.
        """
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS} alternatives per token (got {logprobs})")
        stop = stop_strings(stop, self.tokenizer)
        ids = prompt_ids(prompt, self.tokenizer, self.target.config.vocab_size, self.max_len, max_new_tokens,
                         self._limit_name)
        if grammar is not None:
            self.grammar_compiler().compile(grammar)  # a grammar that does not compile is refused now
        request = Request(tuple(ids), sampling, max_new_tokens, stop, eos_ids(eos_token_ids, self.tokenizer),
                          predicted(prediction, self.tokenizer, self.target.config.vocab_size), logprobs, grammar)
        self._make_room(len(ids) + max_new_tokens)
        seq = Sequence(request, self.tokenizer, on_output)
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

    def _make_room(self, tokens: int) -> None:
        """Grows the slots for a request of ``tokens`` tokens, which only an idle engine can do."""
        if tokens + max(self.spec.longest_draft, MAX_PADDED_ROWS) + 1 <= self.cache_config.max_len:
            return
        if self.has_work:
            raise ValueError(f"a request of {tokens} tokens does not fit the KV slots ({self.cache_config.max_len} "
                             "tokens) while others are served; retry when the engine is idle")
        self._allocate(tokens)

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """Ends a sequence now (from the thread that steps): its slot is free for the next step.

        Args:
            seq: a sequence of this engine; one that already finished is left alone.
            reason: "cancelled" (the client went away) or "error" (the step serving it failed).
        """
        if seq.finished:
            return
        seq.finish(reason)
        self._retire(seq)
        self._emit(seq, [])

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def kv_usage(self) -> float:
        """Share of the cache's token room held by running sequences (0..1)."""
        return sum(self.cache.lengths) / (self.cache_config.slots * self.cache_config.max_len)

    @property
    def learned(self) -> tuple[int, int]:
        """(requests, bytes) the drafters keep from finished requests (one store, shared by every slot's)."""
        return self._drafters[0].learned() if self._drafters else (0, 0)

    def run(self, requests: Seq[dict]) -> list[GenerationResult]:
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
            self._start(seq)
        running = [s for s in self.scheduler.running if not s.finished]
        if not running:
            return
        plan = self._plan(running)
        drafts, draft_s = {}, {}
        for seq in plan.decoding:
            k = self._draft_budget(seq, plan)
            t0 = time.perf_counter()
            drafts[seq] = self._propose(seq, k)
            draft_s[seq] = time.perf_counter() - t0
            plan.drafted(len(drafts[seq].tokens))
        t1 = time.perf_counter()
        verdicts, logprobs, real_rows, logprobs_s = self._forward(running, plan.chunk, drafts)
        verify_s = time.perf_counter() - t1 - logprobs_s
        for seq in running:
            if seq in drafts:
                self._settle(seq, plan, drafts[seq], verdicts[seq], draft_s[seq], verify_s, real_rows,
                             logprobs.get(seq))

    def _plan(self, running: list[Sequence]) -> StepPlan:
        """Shares the row budget: each decoding sequence's fed token, then prompts (oldest first), then drafts.
        With nobody decoding, nobody waits between tokens: prompts then go in larger chunks."""
        config = self.scheduler.config
        decoding = [s for s in running if not s.prompt_pending]
        budget = config.max_rows - len(decoding) if decoding else config.prefill_chunk
        chunk: dict[Sequence, int] = {}
        for seq in running:
            if seq.prompt_pending and budget:
                chunk[seq] = min(seq.prompt_pending, budget)
                budget -= chunk[seq]
        if len(running) == 1 and decoding:  # a lone sequence delays nobody: its long drafts may pass max_rows
            budget = max(budget, self.spec.longest_draft)
        # Who drafts first turns each step, so that no sequence always finds the room taken.
        if decoding:
            turn = self._steps % len(decoding)
            decoding = decoding[turn:] + decoding[:turn]
        self._steps += 1
        # A prompt finished this step decodes in the same forward (its rows follow its last prompt rows), undrafted.
        finished = [seq for seq, n in chunk.items() if n == seq.prompt_pending]
        plan = StepPlan(chunk, decoding + finished, len(decoding) + sum(chunk.values()), budget,
                        sum(s.last_rows - 1 for s in decoding))
        for seq in finished:
            plan.contexts[seq] = self._context(seq, plan.rows - chunk[seq] + plan.expected, len(plan.decoding) - 1)
            plan.budgets[seq] = 0
        return plan

    def _draft_budget(self, seq: Sequence, plan: StepPlan) -> int:
        """The most tokens ``seq`` may draft now: its controller's choice, priced at the step it joins (the
        others' fed tokens, the prompt rows, the drafts proposed before it and, for those still to draft, drafts
        as long as their last ones), within the room left. Drafting past the budget is wasted work: the extra
        tokens would be cut anyway. Nor may a step reach past the cache's next compression step (it would show
        later rows an older cache state)."""
        if seq in plan.budgets:  # its prompt finished in this step
            return 0
        ctx = self._context(seq, plan.turn_of(seq), len(plan.decoding) - 1)
        plan.contexts[seq] = ctx
        if seq.drafter is None:
            plan.budgets[seq] = 0
            return 0
        tick = time.perf_counter()
        # A grammar's forced tokens are drafted besides the controller's choice: they are all but sure.
        forced = len(seq.drafter.forced_ahead()) if isinstance(seq.drafter, ForcedDrafter) else 0
        k = min(seq.controller.next_gamma(ctx) + forced, seq.remaining - 1, self.cache.stable_rows(seq.slot) - 1,
                plan.room)
        seq.stats.control_s += time.perf_counter() - tick
        plan.budgets[seq] = k
        return k

    def _context(self, seq: Sequence, others_rows: int, others: int) -> StepContext:
        return StepContext(seq.remaining, len(seq.tokens), self.max_len, self._cache_fill(), self._kv, others_rows,
                           float(others))

    def _cache_fill(self) -> float | None:
        """Share of the KV budget held: the target's and every drafter's cached tokens, and the prefixes."""
        if self.memory.budget is None:
            return None
        return self.memory.bytes_in_use / self.memory.budget

    def _propose(self, seq: Sequence, k: int) -> Draft:
        if not k:
            return NO_DRAFT
        draft = seq.drafter.propose(seq.tokens, k, seq.request.sampling, seq.generator,
                                    self._stop_rule(seq)).check(k, seq.drafter.name)
        return draft if seq.constraint is None else within(draft, seq.constraint)

    def _stop_rule(self, seq: Sequence) -> StopRule | None:
        """The controller's early stop, timed as control (None, so no signals are computed, unless a controller
        stops early or step records want the signals)."""
        controller, stats = seq.controller, seq.stats
        if not (controller.early_stop or self.record_signals):
            return None

        def timed_stop(position: int, signal: tuple[float, ...]) -> bool:
            tick = time.perf_counter()
            done = controller.stop(position, signal)
            stats.control_s += time.perf_counter() - tick
            return done
        return timed_stop

    def _forward(self, running: list[Sequence], chunk: dict[Sequence, int], drafts: dict[Sequence, Draft]
                 ) -> tuple[dict[Sequence, Verdict], dict[Sequence, list[TokenLogprob]], int, float]:
        """One forward over the step's rows, acceptance, and rollback per slot; returns the verdicts, the
        emitted tokens' log-probabilities of the sequences that asked, the forward's real rows (padding left
        out) and the seconds the log-probabilities took. Only decoding rows get logits."""
        parts = [SequenceRows(seq, seq.slot, self.cache.lengths[seq.slot],
                              seq.tokens[seq.prefilled:seq.prefilled + chunk.get(seq, 0)],
                              seq.tokens[-1] if seq in drafts else None, drafts.get(seq, NO_DRAFT)) for seq in running]
        rows = lay_out(parts)
        real = len(rows.tokens)
        self._pad(rows)
        decoding = [p for p in parts if p.decodes]
        masks = self._grammar_masks(decoding)  # before the forward: they depend only on the drafts
        decided = self._decided(decoding, masks)  # when a grammar leaves every scored row one token: no head at all
        head_rows = LogitRows.NONE if decided else LogitRows.at(torch.tensor(rows.scored, dtype=torch.long))
        out = self.target.forward_rows(torch.tensor(rows.tokens, device=self.target.device), self.cache, rows.slots,
                                       rows.counts, logits=head_rows, features=self._features, parents=rows.parents)
        logits = self._one_hot(decided) if decided else out.logits  # [scored, V]
        hidden = out.features  # [N, F] or None
        for seq, n in chunk.items():
            if hidden is not None and n:  # a head drafter reads the prompt's features as they are computed
                seq.drafter.observe(seq.prefilled, hidden[rows.first[seq]:rows.first[seq] + n])
            seq.prefilled += n
        if not decided:
            self._mask(logits, decoding, masks)
        verdicts = verify_batch(logits, [1 + len(p.draft.tokens) for p in decoding],
                                [Pending(p.draft.tokens, p.draft.q, p.key.request.sampling, p.key.seed,
                                         len(p.key.tokens), p.key.generator, p.draft.parents) for p in decoding])
        logprobs, logprobs_s = {}, 0.0
        if any(p.key.request.logprobs is not None for p in decoding):  # most steps: nobody asked
            start, tick = 0, time.perf_counter()
            for part, verdict in zip(decoding, verdicts):
                asked = part.key.request.logprobs
                if asked is not None:
                    predicting = logits[[start + r for r in verdict_rows(verdict.accepted, verdict.path)]]
                    logprobs[part.key] = token_logprobs(predicting, verdict.tokens, asked)
                start += 1 + len(part.draft.tokens)
            logprobs_s = time.perf_counter() - tick  # kept out of the verification time the controllers learn
        for part, verdict in zip(decoding, verdicts):
            # Keep the fed token and the accepted drafts (a tree's path, moved into place); the emitted target
            # token is fed next step.
            kept = keep_rows(self.cache, part.slot, part.held, verdict)
            if hidden is not None:
                start = rows.first[part.key] + len(part.prompt)
                part.key.drafter.observe(part.held, hidden[[start + r for r in kept]])
        self.target.synchronize()  # before the caller reads its timer
        return {p.key: v for p, v in zip(decoding, verdicts)}, logprobs, real, logprobs_s

    @staticmethod
    def _grammar_masks(decoding: list[SequenceRows]) -> dict[Sequence, np.ndarray]:
        """The allowed tokens at each scored row of the sequences under a grammar (``Constraint.masks``)."""
        masks = {}
        for part in decoding:
            seq = part.key
            if seq.constraint is not None:
                tick = time.perf_counter()
                masks[seq] = seq.constraint.masks(part.draft.tokens, part.draft.parents)
                seq.stats.grammar_s += time.perf_counter() - tick
        return masks

    @staticmethod
    def _decided(decoding: list[SequenceRows], masks: dict[Sequence, np.ndarray]) -> list[int]:
        """Each scored row's token when the grammars leave every scored row of the step one token (in JSON: keys,
        quotes, separators; a third of plain constrained steps in the bench's structured suite), else []: such rows'
        masked distributions are that token alone, whatever the logits, and the step needs no output head. (Leaving
        only some rows of a step out of the head, and reassembling the logits, was no faster with n-gram drafts
        in three paired runs: our kernels run the head's rows in pairs.)"""
        tokens: list[int] = []
        for part in decoding:
            rows = masks.get(part.key)
            sole = sole_tokens(rows) if rows is not None else {}
            if len(sole) != 1 + len(part.draft.tokens):
                return []
            tokens += [sole[row] for row in range(len(sole))]
        return tokens

    def _one_hot(self, tokens: list[int]) -> torch.Tensor:
        """``[len(tokens), V]`` logits of rows whose grammar allows one token: 0 for it, -inf elsewhere (the masked
        row's log-probabilities: 0 for the token, no alternative)."""
        logits = torch.full((len(tokens), self.target.config.vocab_size), float("-inf"), dtype=torch.float32,
                            device=self.target.device)
        logits[range(len(tokens)), tokens] = 0.0
        return logits

    @staticmethod
    def _mask(logits: torch.Tensor, decoding: list[SequenceRows], masks: dict[Sequence, np.ndarray]) -> None:
        """Masks the rows of sequences under a grammar (in place, ``logits`` [scored, V]), so that acceptance,
        sampling and log-probabilities all follow the constrained distribution."""
        start = 0
        for part in decoding:
            seq = part.key
            if seq in masks:
                tick = time.perf_counter()
                mask_rows(logits, start, masks[seq])
                seq.stats.grammar_s += time.perf_counter() - tick
            start += 1 + len(part.draft.tokens)

    def _pad(self, rows: ForwardRows) -> None:
        """Filler rows up to the row count the padding table asks for, within the last run's slot's room.
        (Filler is only ever needed off our kernels, where no prompt is prefilled in a step: the last
        sequence decodes, and its rollback drops them.)"""
        slot = rows.slots[-1]
        room = min(self.cache.stable_rows(slot), self.cache_config.max_len - self.cache.lengths[slot]) - rows.counts[-1]
        rows.pad(self.padding.rows(len(rows.tokens), len(rows.tokens) + room))

    def _settle(self, seq: Sequence, plan: StepPlan, draft: Draft, verdict: Verdict, draft_s: float,
                verify_s: float, real_rows: int, logprobs: list[TokenLogprob] | None = None) -> None:
        """Commits a decoding sequence's step: its tokens, its drafter's and controller's updates, the stats,
        the observer, and its output (with the kept tokens' ``logprobs``; its slot freed first if it finished)."""
        if seq in plan.chunk:
            seq.stats.prefill_s = time.perf_counter() - seq.arrival
        self.cache.commit(seq.slot, self.cache.lengths[seq.slot])  # the fed token and the accepted drafts are verified
        # Cut at EOS, at the token that completes a stop string or the grammar, or at the budget: where plain
        # decoding stops.
        constraint, tokens = seq.constraint, verdict.tokens
        if constraint is not None:
            tokens = tokens[:constraint.until_done(tokens)]
        kept = seq.append(tokens)
        if constraint is not None:
            constraint.advance(kept)
            if constraint.done:
                seq.complete()
        if seq.drafter is not None:
            seq.drafter.commit(seq.tokens)
        seq.last_rows = 1 + len(draft.tokens)
        record = drafter_record(plan.contexts[seq], plan.budgets[seq], draft, verdict, draft_s, verify_s,
                                real_rows - seq.last_rows - plan.chunk.get(seq, 0))
        tick = time.perf_counter()
        seq.controller.update(record)
        stats = seq.stats
        stats.control_s += time.perf_counter() - tick
        stats.record_step(len(draft.tokens), verdict.accepted, len(kept), draft.tree_depth)
        stats.forced_drafted += record.forced
        stats.forced_accepted += record.forced_accepted
        stats.draft_s += draft_s
        stats.verify_s += verify_s
        if self.observer is not None:
            self.observer.stepped(seq, record, len(kept), time.perf_counter())
        if seq.finished:
            self._retire(seq)
        self._emit(seq, kept, None if logprobs is None else logprobs[:len(kept)])

    def _start(self, seq: Sequence) -> None:
        """Gives a newly admitted sequence its controller, drafter and random state, and prefills its prompt
        now unless the decode steps take it in chunks (``_chunked_prefill``)."""
        start = time.perf_counter()
        seq.seed = seq.request.sampling.request_seed()
        seq.generator = seq.request.sampling.generator(self.target.device, seq.seed)
        seq.controller = self._new_controller()
        seq.drafter = self._drafters[seq.slot] if self._drafters else None
        if seq.request.prediction is not None:
            seq.drafter = PredictionDrafter(seq.request.prediction, seq.drafter, self.tokenizer)
        if seq.request.grammar is not None:
            seq.constraint = self.grammar_compiler().start(seq.request.grammar)
            if seq.drafter is not None:  # speculation on: forced tokens are drafted too
                seq.drafter = ForcedDrafter(seq.constraint, seq.drafter)
        # Long drafts (a prediction, a long suffix match) unless speculation is off (gamma 0) and no prediction asks.
        if seq.drafter is not None and self.spec.long_max and (self.spec.gamma != 0 or seq.request.prediction):
            seq.controller = LongDrafts(seq.controller, seq.drafter, self.spec.long_max)
        if seq.drafter is not None:
            seq.drafter.reset(self.cache, seq.request.prompt_ids, self.memory, slot=seq.slot)
        prompt = seq.tokens[:-1]
        if self._chunked_prefill:
            self.cache.commit(seq.slot, len(prompt))  # prompt tokens are verified before they are written
        else:
            observe = seq.drafter.observe if self._features else None
            seq.stats.prefix_hit_tokens = prefill(self.cache, seq.slot, prompt, self.target, self._prefix,
                                                  self._features, observe,
                                                  invariant_rows=self.target.backend.row_invariant)
            seq.prefilled = len(prompt)
            self.target.synchronize()
            seq.stats.prefill_s = time.perf_counter() - start
        if self.observer is not None:
            self.observer.admitted(seq)

    def _retire(self, seq: Sequence) -> None:
        """Records a finished sequence's last figures (its KV bytes, the plain step's cost at its context) and
        frees its slot."""
        stats = seq.stats
        stats.wall_s = time.perf_counter() - seq.arrival
        drafter = seq.drafter.inner if isinstance(seq.drafter, ForcedDrafter) else seq.drafter
        if isinstance(drafter, PredictionDrafter):
            stats.prediction_tokens = len(drafter.prediction.ids)
            stats.prediction_drafted, stats.prediction_accepted = drafter.drafted, drafter.accepted
        if seq.drafter is not None and seq.finish_reason not in ("cancelled", "error") and not self._warming:
            seq.drafter.finish(seq.tokens)  # (the warm-up's dummy request teaches nothing)
        if seq.slot is not None:
            held = self.cache.lengths[seq.slot]
            stats.kv_bytes = self.cache.bytes_used(seq.slot)
            stats.kv_bytes_per_token = stats.kv_bytes / max(1, held)
            own = seq.drafter.own_cache if seq.drafter is not None else None
            if own is not None and own.lengths[0]:
                stats.draft_kv_bytes = own.bytes_used(0)
                stats.draft_kv_bytes_per_token = stats.draft_kv_bytes / own.lengths[0]
            if held and seq.finish_reason not in ("cancelled", "error"):
                stats.decode_step_s = self.step_costs.at(held, lambda: self._time_rows(seq.slot, 1))
            self.cache.reset(seq.slot)
        self.scheduler.remove(seq)
        if self.observer is not None:
            self.observer.finished(seq)

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        if seq.on_output is not None:
            seq.on_output(seq, seq.output(tokens, logprobs))

    # ------------------------------------------------------------------ costs

    @torch.inference_mode()
    def warmup(self, repeats: int = 5) -> None:
        """Serves a short dummy request, so that one-time costs (buffers, kernel selection) stay out of the
        first real requests; off our kernels, tunes the row padding (``RowPadding.tune``: on our kernels cost
        only grows with the rows, and tuning there picks timing noise); then gives cost-aware controllers
        the cost of a forward by its rows, 1 to ``max_rows`` (at most SEEDED_ROWS; the fastest of ``repeats``
        interleaved timings per size, one sequence at a WARMUP_CONTEXT-token context; on row-invariant backends
        remembered on disk for the next start of the same setting, ``costs.remembered_curve``). Call before
        serving."""
        if self.has_work:
            raise RuntimeError("warmup needs an idle engine")
        self._warming = True
        try:
            self.run([dict(prompt=[0] * 16, max_new_tokens=8, eos_token_ids=())])
        finally:
            self._warming = False
        with self._borrowed_slot([0] * WARMUP_CONTEXT) as slot:
            if not self.target.backend.row_invariant:
                self.padding.tune(lambda rows: self._time_rows(slot, rows, pad=False), repeats)
                self.step_costs.clear()  # measured with the old padding
            self.step_costs.at(WARMUP_CONTEXT, lambda: self._time_rows(slot, 1))
            if self._new_controller.uses_costs:
                sizes = range(1, min(self.scheduler.config.max_rows, SEEDED_ROWS) + 1)
                def measure() -> list[float]:
                    return fastest(interleaved_timings(lambda rows: self._time_rows(slot, rows), sizes, repeats))

                # remembered only on row-invariant backends: elsewhere the padding just tuned is part of the cost
                remembered = self.target.backend.row_invariant
                self._new_controller.seed_costs(remembered_curve(self._cost_setting(sizes, repeats), measure,
                                                                 cache_dir() / "costs") if remembered else measure())

    def _cost_setting(self, sizes: range, repeats: int) -> dict[str, object]:
        """Everything a forward's cost depends on (no weight value does): for remembering a measured curve."""
        t = self.target
        return {"config": t.config, "weights": t.weight_format, "backend": t.backend.name, "dtype": t.dtype,
                "device": t.device, "fused": t.runner.fused, "torch": torch.__version__,
                "threads": torch.get_num_threads(), "cpu": cpu_model(), "kernels": source_digest(),
                "cache": self.cache_config, "context": WARMUP_CONTEXT, "sizes": list(sizes), "repeats": repeats}

    @contextmanager
    def verify_timer(self, context: Seq[int]) -> Iterator[Callable[[int], float]]:
        """While the block runs, a free slot holds ``context`` (prefilled); yields ``seconds(k)``: one
        verification forward of k drafted tokens there, as a step runs it (padding included), rolled back."""
        with self._borrowed_slot(context) as slot:
            yield lambda k: self._time_rows(slot, k + 1)

    @contextmanager
    def _borrowed_slot(self, context: Seq[int]) -> Iterator[int]:
        if len(context) + SEEDED_ROWS + MAX_PADDED_ROWS > self.cache_config.max_len:
            self._make_room(len(context) + SEEDED_ROWS)
        slot = self.scheduler.slots.acquire()
        try:
            self.cache.reset(slot)
            prefill(self.cache, slot, list(context), self.target, invariant_rows=self.target.backend.row_invariant)
            yield slot
        finally:
            self.cache.reset(slot)
            self.scheduler.slots.release(slot)

    def _time_rows(self, slot: int, rows: int, pad: bool = True) -> float:
        """Seconds of a forward of ``rows`` rows in ``slot`` (padded as a step pads it) with the logits a step
        reads and their greedy picks, rolled back afterwards so that it changes nothing."""
        held = self.cache.lengths[slot]
        room = min(self.cache.stable_rows(slot), self.cache_config.max_len - held)
        n = self.padding.rows(rows, room) if pad else rows
        tokens = torch.zeros(n, dtype=torch.long, device=self.target.device)
        start = time.perf_counter()
        out = self.target.forward_rows(tokens, self.cache, (slot,), (n,), logits=LogitRows.at(torch.arange(rows)))
        out.logits.argmax(-1)
        self.target.synchronize()
        seconds = time.perf_counter() - start
        self.cache.trim(slot, held)
        return seconds

    def memory_bytes(self) -> dict[str, int]:
        """What this configuration holds: target and draft weights (shared by the slots' drafters), and the
        KV caches as allocated."""
        probe = self._drafters[0] if self._drafters else None
        return {"target_weights": self.target.weight_nbytes, "target_kv": self.cache.nbytes,
                "draft_weights": probe.weight_nbytes if probe is not None else 0,
                "draft_kv": sum(d.own_cache.nbytes for d in self._drafters if d.own_cache is not None)}
