"""Many requests at once: each step drafts for every running sequence, verifies all drafts in one target
forward, and hands each sequence its tokens.

A step is: admit waiting sequences onto free KV slots; share the step's row budget between the
decoding sequences' fed tokens, the prompts still being read (a few rows each step, on our kernels) and
the drafts (each sequence's own controller, priced at the whole forward's rows); draft; run one
row-invariant forward over every sequence's ragged rows, ``[prompt rows][last token, d_1..d_k]``
(``Transformer.forward_rows``); verify (``verify_batch``), roll each slot back to its accepted length and
emit. Rows are computed as they would be alone, so a request's greedy output is bitwise what it is
served alone, and a sampled one (n-gram drafting or none) depends only on its seed.

Each KV slot has a drafter of its own, reset for every sequence it serves: a draft model's or EAGLE
head's cache is that slot's (named ``draft-<slot>`` in the KV memory), and drafters that read the
target's features (trained heads) get their sequence's rows of each forward.

Not here: threads (``serve/loop.py`` steps the executor from one thread), HTTP, or layerskip (it drafts
in the target's own cache slot 0; it runs on :class:`~specdecode.engine.Engine`).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Iterable, Protocol, Sequence as Seq

import torch

from specdecode.batch.scheduler import Scheduler, SchedulerConfig, fit_rows
from specdecode.batch.sequence import Output, Request, Sequence, eos_ids, prompt_ids, stop_strings
from specdecode.control import StepContext, StepRecord, controller_factory
from specdecode.drafters.base import Draft, Drafter, OwnCache
from specdecode.engine import GenerationResult, SpeculativeConfig, keep_rows, kv_setting
from specdecode.kv.cache import CacheConfig
from specdecode.kv.memory import KVMemory
from specdecode.kv.prefill import prefill
from specdecode.models.rows import LogitRows
from specdecode.models.transformer import Transformer
from specdecode.sampling import SamplingParams
from specdecode.timing import interleaved_timings
from specdecode.verify import Pending, Verdict, verify_batch

# Drafters that draft in the target's own cache slot 0, which a batch cannot give them; every other one runs
# (one per KV slot).
SLOT0_DRAFTERS = ("layerskip",)
# The built-in drafters that batch.
BATCHED_DRAFTERS = ("ngram", "ngram-tree", "draft", "draft-tree", "eagle", "eagle-tree", "medusa")


class StepObserver(Protocol):
    """Told what the executor does, from the thread that steps it (e.g. ``serve/metrics.py``)."""

    def admitted(self, seq: Sequence) -> None:
        """A sequence got a slot and its prompt was prefilled."""

    def stepped(self, seq: Sequence, record: StepRecord, emitted: int, now: float) -> None:
        """A sequence's step: its record, the tokens it kept, and when."""

    def finished(self, seq: Sequence) -> None:
        """A sequence ended (any reason, cancellation included) and left its slot."""


class BatchEngine:
    """Serves many requests together with per-request speculation.

    Args:
        target: the model whose output distribution is reproduced exactly.
        tokenizer: for text prompts, stop strings and text output.
        new_drafter: makes a drafter (None: plain decoding), called once per KV slot; see BATCHED_DRAFTERS.
        spec: gamma policy; each sequence gets its own controller, sharing the engine's cost estimates.
        cache: KV settings; ``slots`` is taken from the scheduler's ``max_running`` and ``max_len`` per slot
            from ``max_len``.
        scheduler: how many sequences run and wait.
        max_len: tokens one sequence may hold (prompt + generated); default: the model's context, at most 4,096.
        observer: told of admissions, steps and finished sequences (metrics).
    """

    def __init__(self, target: Transformer, tokenizer=None, new_drafter: Callable[[], Drafter | None] | None = None,
                 spec: SpeculativeConfig = SpeculativeConfig(), cache: CacheConfig = CacheConfig(),
                 scheduler: SchedulerConfig = SchedulerConfig(), max_len: int | None = None,
                 observer: StepObserver | None = None) -> None:
        probe = new_drafter() if new_drafter is not None else None
        if probe is not None and probe.name in SLOT0_DRAFTERS:
            raise ValueError(f"drafter {probe.name!r} cannot serve a batch (it drafts in the target's cache slot 0); "
                             f"batched drafters: {', '.join(BATCHED_DRAFTERS)}, or none")
        self.target = target
        self.tokenizer = tokenizer
        self.spec = spec if probe is not None else SpeculativeConfig(gamma=0)
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
        self.scheduler = Scheduler(scheduler)
        self.memory = KVMemory(cache.budget, cache.prefix_cache)
        # Each slot holds a sequence plus one step's drafted (or padding) rows beyond it.
        room = self.max_len + self.spec.max_draft + 2
        self.cache_config = replace(cache, slots=scheduler.max_running, max_len=-(-room // 64) * 64)
        self.cache = self.memory.new_cache("target", target, self.cache_config)
        self._prefix = self.memory.prefix_for(target, self.cache_config)
        self._kv = kv_setting(cache, target.dtype)
        # oneDNN and F.linear round a one-row matmul differently from a multi-row one (see Engine).
        self._min_rows = 1 if target.backend.row_invariant else 2
        # Prompts are prefilled a few rows at a time inside the decode forwards where rows are computed alike in
        # any forward (our kernels) and the cache neither compresses nor shares prefixes (those prefill in
        # fixed chunks at admission, as the single-request engine does).
        self._chunked_prefill = target.backend.row_invariant and not cache.compressed and not cache.prefix_cache
        self.observer = observer

    @torch.inference_mode()
    def warmup(self, repeats: int = 5) -> None:
        """Serves a short dummy request, so that one-time costs (buffers, kernel selection) stay out of the
        first real requests, then gives cost-aware controllers the cost of a forward by its rows, 1 to
        ``max_rows`` (the fastest of ``repeats`` interleaved timings per size, one sequence at a 64-token
        context: projections, which grow with the rows, dominate). Call before serving."""
        if self.has_work:
            raise RuntimeError("warmup needs an idle engine")
        self.run([dict(prompt=[0] * 16, max_new_tokens=8, eos_token_ids=())])
        if not self._new_controller.uses_costs:
            return
        slot, context = self.scheduler.slots.acquire(), 64
        try:
            self.cache.reset(slot)
            prefill(self.cache, slot, [0] * context, self.target)

            def verify(k: int) -> float:
                start = time.perf_counter()
                self.target.forward_rows(torch.zeros(k + 1, dtype=torch.long, device=self.target.device), self.cache,
                                         (slot,), (k + 1,))
                seconds = time.perf_counter() - start
                self.cache.trim(slot, context)
                return seconds
            times = interleaved_timings(verify, range(self.scheduler.config.max_rows), repeats)
            self._new_controller.seed_costs([min(t) for t in times])
        finally:
            self.cache.reset(slot)
            self.scheduler.slots.release(slot)

    def submit(self, prompt: str | Seq[int], sampling: SamplingParams = SamplingParams(), max_new_tokens: int = 128,
               stop: str | Iterable[str] = (), eos_token_ids: Iterable[int] | None = None,
               on_output: Callable[[Sequence, Output], None] | None = None) -> Sequence:
        """Queues a request; it starts at a later :meth:`step`. Arguments as for ``Engine.stream``.

        Raises:
            ValueError: bad input (named).
            QueueFullError: the waiting queue is full.
        """
        stop = stop_strings(stop, self.tokenizer)
        ids = prompt_ids(prompt, self.tokenizer, self.target.config.vocab_size, self.max_len, max_new_tokens,
                         "the engine's max_len per sequence")
        request = Request(tuple(ids), sampling, max_new_tokens, stop, eos_ids(eos_token_ids, self.tokenizer))
        seq = Sequence(request, self.tokenizer, on_output)
        self.scheduler.add(seq)
        return seq

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

    @torch.inference_mode()
    def step(self) -> None:
        """Admits waiting sequences, then runs one forward for every running one: prompt rows of those still
        prefilling (oldest first, within the row budget) and [last token, drafts] of those decoding."""
        for seq in self.scheduler.admit():
            self._start(seq)
        running = [s for s in self.scheduler.running if not s.finished]
        if not running:
            return
        config = self.scheduler.config
        decoding_before = [s for s in running if not s.prompt_pending]
        # Rows go to each decoding sequence's fed token, then to prompts (oldest first), then to drafts. With
        # nobody decoding, nobody waits between tokens: prompts then go in larger chunks.
        budget = config.max_rows - len(decoding_before) if decoding_before else config.prefill_chunk
        chunk: dict[Sequence, int] = {}
        for seq in running:
            if seq.prompt_pending and budget:
                chunk[seq] = min(seq.prompt_pending, budget)
                budget -= chunk[seq]
        tick = time.perf_counter()
        # What the others put in this forward: their fed tokens, the prompt rows, and drafts as long as
        # their last ones (a draft prices its share of the step).
        rows_before = sum(s.last_rows for s in decoding_before) + sum(chunk.values())
        contexts = {s: self._context(s, rows_before - s.last_rows, len(decoding_before) - 1) for s in decoding_before}
        wanted = [min(s.controller.next_gamma(contexts[s]), s.remaining - 1, self.cache.stable_rows(s.slot) - 1)
                  if s.drafter is not None else 0 for s in decoding_before]
        ks = dict(zip(decoding_before, fit_rows(wanted, len(decoding_before) + budget)))
        # A prompt finished this step decodes in the same forward (its rows follow its last prompt rows).
        for seq, n in chunk.items():
            if n == seq.prompt_pending:
                contexts[seq] = self._context(seq, rows_before, len(decoding_before))
                ks[seq] = 0
        decoding = [s for s in running if s in ks]
        control_s = (time.perf_counter() - tick) / len(running)
        drafts, draft_s = {}, {}
        for seq in decoding:
            t0 = time.perf_counter()
            stop = seq.controller.stop if seq.controller.early_stop else None
            k, params = ks[seq], seq.request.sampling
            drafts[seq] = seq.drafter.propose(seq.tokens, k, params, seq.generator, stop).check(k, seq.drafter.name) \
                if k else Draft([])
            draft_s[seq] = time.perf_counter() - t0
        t1 = time.perf_counter()
        verdicts, total_rows = self._forward(running, chunk, drafts)
        verify_s = time.perf_counter() - t1
        now = time.perf_counter()
        for seq in decoding:
            if seq in chunk:
                seq.stats.prefill_s = now - seq.arrival
            draft, verdict, d_s = drafts[seq], verdicts[seq], draft_s[seq]
            self.cache.commit(seq.slot, self.cache.lengths[seq.slot])
            kept = seq.append(verdict.tokens)
            if seq.drafter is not None:
                seq.drafter.commit(seq.tokens)
            seq.last_rows = 1 + len(draft.tokens)
            record = StepRecord(contexts[seq], ks[seq], len(draft.tokens), verdict.accepted, d_s, verify_s,
                                draft.signals, others_rows=total_rows - seq.last_rows - chunk.get(seq, 0))
            seq.controller.update(record)
            seq.stats.record_step(len(draft.tokens), verdict.accepted, len(kept), draft.tree_depth)
            seq.stats.draft_s += d_s
            seq.stats.verify_s += verify_s
            seq.stats.control_s += control_s
            if self.observer is not None:
                self.observer.stepped(seq, record, len(kept), time.perf_counter())
            if seq.finished:
                self._retire(seq)
            self._emit(seq, kept)

    def _start(self, seq: Sequence) -> None:
        """Gives a newly admitted sequence its controller, drafter and random state, and prefills its prompt
        now unless the decode steps take it in chunks (``_chunked_prefill``)."""
        start = time.perf_counter()
        seq.seed = seq.request.sampling.request_seed()
        seq.generator = seq.request.sampling.generator(self.target.device, seq.seed)
        seq.controller = self._new_controller()
        seq.drafter = self._drafters[seq.slot] if self._drafters else None
        if seq.drafter is not None:
            seq.drafter.reset(self.cache, seq.request.prompt_ids, self.memory)
        prompt = seq.tokens[:-1]
        if self._chunked_prefill:
            self.cache.commit(seq.slot, len(prompt))  # prompt tokens are verified before they are written
        else:
            observe = seq.drafter.observe if self._features else None
            seq.stats.prefix_hit_tokens = prefill(self.cache, seq.slot, prompt, self.target, self._prefix,
                                                  self._features, observe,
                                                  invariant_rows=self.target.backend.row_invariant)
            seq.prefilled = len(prompt)
            seq.stats.prefill_s = time.perf_counter() - start
        if self.observer is not None:
            self.observer.admitted(seq)

    def _context(self, seq: Sequence, others_rows: int, others: int) -> StepContext:
        return StepContext(seq.remaining, len(seq.tokens), self.max_len, self._cache_fill(), self._kv, others_rows,
                           float(others))

    def _forward(self, running: list[Sequence], chunk: dict[Sequence, int],
                 drafts: dict[Sequence, Draft]) -> tuple[dict[Sequence, Verdict], int]:
        """One forward over the step's rows, acceptance, and rollback per slot; returns the verdicts and the
        forward's rows.

        Each sequence's rows are consecutive: its prompt rows for this step (if any), then, if it decodes,
        [last token, d_1..d_k]. Only decoding rows get logits.
        """
        rows, slots, counts, parents, scored, held, first_row = [], [], [], [], [], {}, {}
        for seq in running:
            n = chunk.get(seq, 0)
            part = seq.tokens[seq.prefilled:seq.prefilled + n]
            first_row[seq] = len(rows)
            tree = None
            if seq in drafts:
                held[seq] = self.cache.lengths[seq.slot] + n  # every token but the last is cached then
                scored += range(len(rows) + n, len(rows) + n + 1 + len(drafts[seq].tokens))
                part += [seq.tokens[-1], *drafts[seq].tokens]
                tree = drafts[seq].row_parents(offset=n)
            if part:
                rows += part
                slots.append(seq.slot)
                counts.append(len(part))
                parents.append(None if tree is None else list(range(-1, n - 1)) + tree)  # prompt rows: a chain
        # Filler rows (copies of the last row, rolled back) bring a forward up to _min_rows; they come after
        # the last sequence's real rows, so no real row sees them. (Only off our kernels, where no prompt is
        # prefilled here: the last sequence decodes, and its rollback drops them.)
        filler = max(0, self._min_rows - len(rows))
        if filler and parents[-1] is not None:
            parents[-1] += range(counts[-1] - 1, counts[-1] - 1 + filler)
        counts[-1] += filler
        rows += [rows[-1]] * filler
        out = self.target.forward_rows(torch.tensor(rows, device=self.target.device), self.cache, slots, counts,
                                       logits=LogitRows.at(torch.tensor(scored, dtype=torch.long)),
                                       features=self._features, parents=parents)
        logits, hidden = out.logits, out.features  # [scored, V], [N, F] or None
        for seq, n in chunk.items():
            if hidden is not None and n:  # a head drafter reads the prompt's features as they are computed
                seq.drafter.observe(seq.prefilled, hidden[first_row[seq]:first_row[seq] + n])
            seq.prefilled += n
        decoding = list(drafts)
        verdicts = verify_batch(logits, [1 + len(drafts[s].tokens) for s in decoding],
                                [Pending(drafts[s].tokens, drafts[s].q, s.request.sampling, s.seed, len(s.tokens),
                                         s.generator, drafts[s].parents) for s in decoding])
        for seq, verdict in zip(decoding, verdicts):
            # Keep the fed token and the accepted drafts (a tree's path, moved into place); the emitted target
            # token is fed next step.
            kept = keep_rows(self.cache, seq.slot, held[seq], verdict)
            if hidden is not None:
                start = first_row[seq] + chunk.get(seq, 0)
                seq.drafter.observe(held[seq], hidden[[start + r for r in kept]])
        return dict(zip(decoding, verdicts)), len(rows)

    def _retire(self, seq: Sequence) -> None:
        """Records a finished sequence's last figures and frees its slot."""
        seq.stats.wall_s = time.perf_counter() - seq.arrival
        if seq.slot is not None:
            seq.stats.kv_bytes = self.cache.bytes_used(seq.slot)
            seq.stats.kv_bytes_per_token = seq.stats.kv_bytes / max(1, self.cache.lengths[seq.slot])
            self.cache.reset(seq.slot)
        self.scheduler.remove(seq)
        if self.observer is not None:
            self.observer.finished(seq)

    def _emit(self, seq: Sequence, tokens: list[int]) -> None:
        if seq.on_output is not None:
            seq.on_output(seq, seq.output(tokens))

    def _cache_fill(self) -> float | None:
        if self.memory.budget is None:
            return None
        return (self.cache.bytes_used() + self.memory.prefix_bytes) / self.memory.budget

    def run(self, requests: Seq[dict]) -> list[GenerationResult]:
        """Serves ``requests`` (keyword arguments of :meth:`submit`) together; results in their order."""
        pending, sequences = list(requests), []
        while pending or self.has_work:
            while pending and self.scheduler.can_accept:
                sequences.append(self.submit(**pending.pop(0)))
            self.step()
        return [result_of(s) for s in sequences]


def result_of(seq: Sequence) -> GenerationResult:
    """A finished sequence as ``Engine.generate`` returns a request."""
    return GenerationResult(seq.text, list(seq.generated), seq.finish_reason, seq.stats)
