"""Admission and retirement: what a sequence gets when it takes a KV slot, and what it leaves when it gives it back.

Starting a sequence gives it its seed and generator, its grammar's matcher, its drafter chain (the slot's drafter
with the request's prediction and grammar in front, ``drafters/chain.py``), a controller (wrapped for long drafts
where a source may run past ``gamma_max``), and prefills its prompt: now, or row by row inside the decode steps
where those take prompts (``chunked``; a stored prefix is loaded first). Retiring it records its last figures (KV bytes, the prediction's counts,
the plain step's cost at its context), lets drafters that learn across requests keep its output, and empties the
slot. Each KV slot has a drafter of its own, reset for every sequence the slot serves and handed that slot.

It does not choose who is admitted (``scheduler.py``), run decode steps or tell the observer (``executor.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from specdecode.batch.costs import StepTimer
from specdecode.batch.scheduler import Scheduler
from specdecode.batch.sequence import SequenceState
from specdecode.batch.target_kv import TargetKV
from specdecode.control import ControllerFactory, GammaController
from specdecode.control.config import SpeculativeConfig
from specdecode.control.long import LongDrafts
from specdecode.drafters.base import Drafter
from specdecode.drafters.chain import chain_for
from specdecode.grammar import GrammarCompiler
from specdecode.models.prefill import prefill
from specdecode.models.transformer import Transformer


def slot_drafters(new_drafter: Callable[[], Drafter | None] | None, slots: int) -> list[Drafter]:
    """One drafter per KV slot (none for plain decoding), reused by the sequences the slot serves; a drafter with a
    cache of its own names it after its slot (``draft-<slot>`` in the KV memory)."""
    first = new_drafter() if new_drafter is not None else None
    if first is None:
        return []
    drafters = [first, *(new_drafter() for _ in range(slots - 1))]
    for slot, drafter in enumerate(drafters):
        drafter.name_cache(f"draft-{slot}")
    return drafters


@dataclass(kw_only=True)
class Admission:
    """Starts and retires the engine's sequences.

    Args:
        target: the model.
        kv: its cache over the engine's slots.
        drafters: the slots' drafters (empty: plain decoding unless a request brings a prediction).
        new_controller: makes each sequence's controller.
        spec: the speculation settings (``long_max``; gamma 0 keeps long drafts to predictions).
        grammars: the engine's grammar compiler (made on first use).
        timer: times the plain step at a retiring sequence's context.
        scheduler: frees a retired sequence's slot.
        tokenizer: finds a lost place in a prediction again by text.
        chunked: prompts are prefilled inside the decode steps' forwards, not at admission.
        features: the target layers whose features the drafters read (the prompt's at prefill).
    """

    target: Transformer
    kv: TargetKV
    drafters: list[Drafter]
    new_controller: ControllerFactory
    spec: SpeculativeConfig
    grammars: Callable[[], GrammarCompiler]
    timer: StepTimer
    scheduler: Scheduler
    tokenizer: object | None = None
    chunked: bool = False
    features: tuple[int, ...] = ()
    warming: bool = False  # serving the warm-up's dummy request, which teaches the drafters nothing

    def start(self, seq: SequenceState) -> None:
        """Gives a newly admitted sequence its random state, grammar, drafter chain and controller, and prefills its
        prompt unless the decode steps take it in chunks."""
        start, request = time.perf_counter(), seq.request
        seq.seed = request.sampling.request_seed()
        seq.generator = request.sampling.generator(self.target.device, seq.seed)
        if request.grammar is not None:
            seq.constraint = self.grammars().start(request.grammar)
        seq.drafter = chain_for(self.drafters[seq.slot] if self.drafters else None, request.prediction,
                                seq.constraint, self.tokenizer)
        seq.controller = self._controller(seq)
        if seq.drafter is not None:
            seq.drafter.reset(self.kv.cache, request.prompt_ids, self.kv.memory, slot=seq.slot)
        prompt = seq.tokens[:-1]
        if self.chunked:
            self.kv.cache.commit(seq.slot, len(prompt))  # prompt tokens are verified before they are written
            seq.prefilled = seq.stats.prefix_hit_tokens = self.kv.load_prefix(seq.slot, prompt)
            return
        observe = seq.drafter.observe if self.features else None
        seq.stats.prefix_hit_tokens = prefill(self.kv.cache, seq.slot, prompt, self.target, self.kv.prefix,
                                              self.features, observe, invariant_rows=self.target.backend.row_invariant)
        seq.prefilled = len(prompt)
        self.target.synchronize()
        seq.stats.prefill_s = time.perf_counter() - start

    def _controller(self, seq: SequenceState) -> GammaController:
        """The sequence's controller; long drafts (a prediction, a long suffix match) may pass its bound unless
        speculation is off (gamma 0) and no prediction asks."""
        controller = self.new_controller()
        if seq.drafter is not None and self.spec.long_max and (self.spec.gamma != 0 or seq.request.prediction):
            shared = self.new_controller.shared  # the step costs, where the controllers weigh them
            controller = LongDrafts(controller, seq.drafter, self.spec.long_max,
                                    costs=shared.costs if shared is not None else None)
        return controller

    def retire(self, seq: SequenceState) -> None:
        """Records a finished sequence's last figures and frees its slot."""
        stats = seq.stats
        stats.wall_s = time.perf_counter() - seq.arrival
        served = seq.finish_reason not in ("cancelled", "error")
        if seq.drafter is not None:
            counts = seq.drafter.prediction_counts()
            if counts is not None:
                stats.prediction_tokens, stats.prediction_drafted = counts.tokens, counts.drafted
                stats.prediction_accepted = counts.accepted
            if served and not self.warming:
                seq.drafter.finish(seq.tokens)
        if seq.slot is not None:
            self._empty_slot(seq, served)
        self.scheduler.remove(seq)

    def _empty_slot(self, seq: SequenceState, served: bool) -> None:
        """The KV bytes a sequence held (its drafter's own cache too) and the plain step's cost at its context, then
        its slot emptied."""
        stats, cache = seq.stats, self.kv.cache
        held = cache.lengths[seq.slot]
        stats.kv_bytes = cache.bytes_used(seq.slot)
        stats.kv_bytes_per_token = stats.kv_bytes / max(1, held)
        own = seq.drafter.own_cache if seq.drafter is not None else None
        if own is not None and own.lengths[0]:
            stats.draft_kv_bytes = own.bytes_used(0)
            stats.draft_kv_bytes_per_token = stats.draft_kv_bytes / own.lengths[0]
        if held and served:
            stats.decode_step_s = self.timer.plain_step_s(seq.slot, held)
        cache.reset(seq.slot)
