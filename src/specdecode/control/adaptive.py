"""``adaptive``: speculate while drafting measurably pays, each draft as long as its confidence says.

For a drafter with a fitted acceptance model (``model_file.py``), it drafts up to ``gamma_max`` and
stops at the first token after which one more is not worth its time: the expected gain of the next
token (the chance that it and all before it are accepted, from the calibrated acceptance model of
``confidence.py``) per second it costs (one draft token plus the verification's growth) falls below
the step's expected tokens per second so far. It speculates while the measured
speed of its drafting steps (tokens per second against its own timed plain steps', a decayed ratio
of sums carried across requests) beats plain decoding, and once off turns back on only when it beats
it by ``margin``; while off, a draft now and then (``cost``'s probe spacing, at least one per 32
steps) measures again; while on, a plain step after ``refresh`` drafting steps without one times a
plain step again (``SharedEstimates.learn_plain``). On/off goes by measured speed rather than by
``cost``'s model because confident stopping makes drafting pay where per-position acceptance says it
would not: replaying the Qwen pair's drafts (``benchmarks/replay_gamma.py``), ``adaptive`` runs 1.41x
plain decoding, ``cost`` 1.06x. That measured speed is a lone sequence's: in a batch (a step shared
with others, whose rows its time holds) on/off goes by ``cost``'s batch price (``best_gamma`` at the
forward's rows, with ``cost``'s margin) and probes at ``cost``'s spacing, and only steps run alone teach the
measured speed.

For n-gram lookup, whose tokens cost only verification rows, the match statistics say when a
proposal is weak (one short, rare match: stop after its first token) or strong (draft on). Without a
fitted model for the drafter it is ``cost``. It fits nothing offline.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.control.base import Signal, StepContext, StepRecord, memory_cap
from specdecode.control.confidence import CalibratedAcceptance
from specdecode.control.cost import CostGamma, OffSwitch
from specdecode.control.estimates import SharedEstimates, best_gamma
from specdecode.control.model_file import AcceptanceModel


@dataclass
class AdaptiveGamma:
    """Measured on/off with probes, confidence-based draft length by marginal tokens per second.

    Args:
        model: the acceptance model for the drafter in use, or None (then: ``cost``'s gamma).
        gamma_max: the longest draft (shortened near the memory budget).
        shared: step costs, long-run acceptance and drafting speed, shared with the engine's other
            requests (None: this request's own).
        margin: how much faster than plain decoding drafting steps must have run to turn speculation
            back on once it is off (it goes off when they ran slower than plain decoding).
        refresh: most drafting steps (across requests) before a plain step is run to time one again
            (a request's last token is a plain step anyway; costs about 1/refresh of drafting's gain).
    """

    model: AcceptanceModel | None = None
    gamma_max: int = 8
    shared: SharedEstimates | None = None
    margin: float = 0.03
    refresh: int = 32

    def __post_init__(self) -> None:
        self.cost = CostGamma(gamma_max=self.gamma_max, shared=self.shared)
        # Probes judged by measured speed need more of them than cost's model-based probes (2% of the
        # time, at most one per 64 steps: none at all in a 64-token request).
        self.off = OffSwitch(probe_overhead=0.05, max_interval=32)
        self.batch_off = OffSwitch()  # cost's spacing, for steps shared with other sequences
        self.shared = self.cost.shared
        self.acceptance = CalibratedAcceptance(self.model) if self.model is not None else None
        self._ctx: StepContext | None = None
        self._on = True
        self._stopping = False
        self._all_accepted = 1.0
        self._tokens = 1.0
        self._rates: list[float] = []  # in a batch: the step's tokens per second with each drafted token

    @property
    def early_stop(self) -> bool:
        """Whether this step's draft stops by confidence (the engine then asks the drafter for signals)."""
        return self._stopping

    def _by_confidence(self) -> bool:
        # Until a draft has been timed (the first step of an engine), ``cost``'s start gamma.
        return self.acceptance is not None and self.cost.costs.ready

    def next_gamma(self, ctx: StepContext) -> int:
        self._stopping = False
        if not self._by_confidence():
            return self.cost.next_gamma(ctx)
        cap = min(memory_cap(ctx, self.gamma_max), ctx.remaining - 1)
        if cap <= 0:
            return 0
        # In a batch on/off goes by cost's model, so it probes as cost does (2% of the time, not the 5% that judging
        # by measured speed needs): each probe slows the whole step, and at c = 8 the 5% was the loss (history).
        switch = self.batch_off if ctx.others_rows else self.off
        if switch.decide(cap if self._pays(ctx, cap) else 0, cap, self.cost.costs, ctx) == 0:
            return 0
        if not ctx.others_rows and self.shared.plain_age >= self.refresh:
            return 0  # time a plain step again: drafting's speed is judged against it
        self._stopping = True
        self._ctx, self._all_accepted, self._tokens, self._rates = ctx, 1.0, 1.0, []
        return cap  # a probe too: it shows what drafting gains as drafting is done

    def _pays(self, ctx: StepContext, cap: int) -> bool:
        """Whether to draft this step. Alone: while drafting steps measurably beat plain ones (hysteresis:
        once off, back on only with the margin; near break-even, as self-speculation on SmolLM2 is, flapping
        costs the probes' drafts). In a batch: when the cost model says a draft raises the whole step's
        tokens per second (a lone sequence's measured speed says nothing about a step whose rows it shares:
        where one more row starts another pass of the kernel over the weights, it costs several rows)."""
        if ctx.others_rows:  # with cost's margin: the model leaves out speculation's own bookkeeping
            return best_gamma(self.cost.acceptance.cumulative(cap), self.cost.costs, self.cost.margin,
                              ctx.others_rows, ctx.others_tokens) > 0
        self._on = self.shared.gain >= 1.0 + (0.0 if self._on else self.margin)
        return self._on

    def stop(self, position: int, signal: Signal) -> bool:
        if not self._stopping:
            return False
        p = self.acceptance.predict(signal, position, self._ctx)
        self._all_accepted *= p
        self._tokens += self._all_accepted
        costs, ctx = self.cost.costs, self._ctx
        drafted = position + 1
        step_s = costs.step_s(drafted, ctx.others_rows)
        # Next token: gain P_i * p (p standing in for its own acceptance) over extra seconds, vs tokens/s so
        # far (in a batch, the whole step's: the others' tokens wait for the longer forward too).
        extra_s = costs.step_s(drafted + 1, ctx.others_rows) - step_s
        if ctx.others_rows:
            self._rates.append((self._tokens + ctx.others_tokens) / step_s)
        return self._all_accepted * p * step_s < extra_s * (self._tokens + ctx.others_tokens)

    def keep(self, drafted: int) -> int:
        """In a batch, the draft's best prefix by its tokens' confidence, or none when even that prefix does not
        beat the plain step by ``cost``'s margin. Whether to draft was decided by per-position acceptance before
        any token was seen, and the tokens that stop the draft early are known only after: a one-token draft
        stopped there costs the row of a 9th (a kernel's new pass at c = 8) for at most one token of eight."""
        if not (self._stopping and self._ctx.others_rows) or len(self._rates) < drafted or not drafted:
            return drafted
        ctx, costs = self._ctx, self.cost.costs
        plain = (1.0 + ctx.others_tokens) / costs.step_s(0, ctx.others_rows) * (1.0 + self.cost.margin)
        best = max(range(drafted), key=self._rates.__getitem__)
        return best + 1 if self._rates[best] > plain else 0

    def update(self, record: StepRecord) -> None:
        # Drafting's measured speed is a lone sequence's: a step shared with others times their rows too.
        if not record.others_rows:
            if self._stopping and record.drafted:
                # A draft model's first draft after plain steps also catches up on them: not drafting's cost. Its
                # time is then an upper bound, below an estimate that one slow draft inflated (which would hold
                # every probe's speed down and drafting off: see StepCosts.update).
                draft_s = (record.draft_s if self.cost.drafted_before
                           else min(record.draft_s, record.drafted * self.cost.costs.draft_per_token))
                self.shared.learn_gain(record.accepted + 1, draft_s + record.verify_s)
            elif self._by_confidence():
                self.shared.learn_gain()
            if not record.drafted:
                self.shared.learn_plain(record.verify_s)
        self.cost.update(record)
        if self.acceptance is not None:
            self.acceptance.learn(record)
