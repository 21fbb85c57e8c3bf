"""Online estimates the cost-aware controllers share: per-position acceptance, step costs, expected rate.

Plain Python on a few floats (no tensors): they run on every step. They do not choose gamma.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class PositionAcceptance:
    """Per-position conditional acceptance p_i = P(draft token i accepted | the tokens before it were).

    Exponentially decayed counts; each position's estimate leans (``strength`` pseudo-counts) on a pooled
    estimate: the first position on all positions' evidence, later ones on the later positions' only,
    and those on their priors. Keeping the first position apart matters: whether a draft starts right
    and whether it goes on once it did are different odds (n-gram lookup on SmolLM2: 0.3 and 0.8), and
    pooling them made drafts short, which then never showed what later positions accept.

    Args:
        gamma_max: positions tracked.
        prior: acceptance of the first drafted token assumed before any evidence.
        later_prior: acceptance of a later drafted token, once those before it were accepted, assumed
            before any evidence (optimistic, so that long drafts get tried).
        decay: weight kept by older evidence at each drafting step.
        strength: pseudo-counts of the pooled (and prior) estimates.
    """

    gamma_max: int
    prior: float = 0.6
    later_prior: float = 0.7
    decay: float = 0.9
    strength: float = 2.0
    seen: list[float] = field(init=False)
    hits: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.seen = [0.0] * self.gamma_max
        self.hits = [0.0] * self.gamma_max
        self._cumulative: list[float] | None = None  # [P_1..P_gamma_max] until the evidence changes

    def update(self, drafted: int, accepted: int) -> None:
        """Counts one step: positions up to the first rejection were judged, later ones never were."""
        if not drafted:
            return
        self.forget(self.decay)
        for i in range(min(drafted, accepted + 1, self.gamma_max)):
            self.seen[i] += 1.0
            self.hits[i] += i < accepted

    def forget(self, keep: float) -> None:
        """Scales all evidence by ``keep`` (0..1)."""
        self.seen = [s * keep for s in self.seen]
        self.hits = [h * keep for h in self.hits]
        self._cumulative = None

    @property
    def pooled(self) -> float:
        """Acceptance over all positions, leaning on ``prior``."""
        return (sum(self.hits) + self.strength * self.prior) / (sum(self.seen) + self.strength)

    @property
    def later(self) -> float:
        """Acceptance over the positions after the first, leaning on ``later_prior``."""
        return (sum(self.hits[1:]) + self.strength * self.later_prior) / (sum(self.seen[1:]) + self.strength)

    def cumulative(self, k: int) -> list[float]:
        """[P_1..P_k]: P_i = p_1 * ... * p_i, the chance that the first i drafted tokens are all accepted. Kept
        until the evidence changes (every decoding sequence reads it each step; most steps of a batch draft
        nothing, so learn nothing)."""
        if self._cumulative is None:
            pooled, later = self.pooled, self.later
            out, prob = [], 1.0
            for i in range(self.gamma_max):
                prob *= (self.hits[i] + self.strength * (later if i else pooled)) / (self.seen[i] + self.strength)
                out.append(prob)
            self._cumulative = out
        return self._cumulative[:k]


def smoothed(old: float | None, new: float, weight: float) -> float:
    """Exponential smoothing: ``new`` with ``weight``, the old estimate with the rest (``new`` if none yet)."""
    return new if old is None else old + weight * (new - old)


def verify_shape(k: int, slope: float) -> float:
    """Prior verification cost of k drafted tokens relative to a plain step: 1 + slope * k.

    Where plain steps run two rows (outside our kernels, see ``Engine._verify``) k = 0 really costs
    about what k = 1 does; the learnt curve corrects that once a plain step has run.
    """
    return 1.0 + slope * k


OUTLIER = 2.0  # a timed step counts as at most this many times (or this share of) what the curve expects


@dataclass
class StepCosts:
    """Online step costs in seconds: drafting per token, and verification by the number of tokens verified.

    Verification is ``base * shape[k]``: ``base`` follows every step quickly (costs drift as the context
    grows), ``shape`` (starting from :func:`verify_shape`, or from a measured curve, see :meth:`seed`)
    learns the curve v(k) slowly from the k that ran, relative to ``shape[0] = 1``. Both used to move at a plain
    step: their split was free, and each host hiccup (a step timed 8-14x its like, a few a run on a shared VM)
    left ``base`` higher and the shape of the k that ran lower, so the k that seldom ran were priced up step after
    step (SmolLM2's suites, 4500 steps: a 2-token draft at 2.5x its measured cost; ``adaptive`` then drafted
    shorter still). Now ``shape[0]`` stays 1 and a step counts as at most OUTLIER times (or 1/OUTLIER) what the
    curve expects. An engine keeps one for all its requests (see :class:`SharedEstimates`).

    In a batch (``others`` > 0) the forward also holds other sequences' rows: the curve is then read at
    the forward's total rows, ``others + k + 1``. Past the rows it covers (prompt rows beside decoding ones
    reach further) each row costs the curve's mean row, and those steps teach it nothing: a curve that stopped
    there would price rows past it at nothing, and a prompt chunk's forward learnt at the top would price
    every full batch step as that chunk. Inside it a batch's step teaches ``base`` alone: no step of one row
    runs among them to pin the split, so the rows that run most (every sequence's fed token) took up the
    contexts' growth while the rows that run seldom kept their old share. At c = 8 (SmolLM2, Zen 4) the 8-,
    9- and 10-row points went from the warm-up's 1.78 / 2.02 / 2.12 to 2.12 / 2.12 / 2.14 within a run, where
    the run's own steps took 9.6 / 10.5 / 11.7 ms: a 9th row looked free, and one-token drafts that cost 9% of
    the step were taken. The curve's shape there stays as timed at warm-up (:meth:`seed`) or learnt alone.

    Args:
        gamma_max: longest draft tracked.
        max_rows: most rows one forward holds (a batch's); the curve covers them (0: 1 + gamma_max).
        verify_slope: prior extra verification cost per drafted token, relative to a plain step
            (torch on CPU: verifying 8 tokens costs about 1.13 plain steps, measured when this was written).
        smoothing: weight of the newest step in ``base`` and the draft cost.
        shape_smoothing: weight of the newest step in ``shape``.
    """

    gamma_max: int
    max_rows: int = 0
    verify_slope: float = 0.02
    smoothing: float = 0.3
    shape_smoothing: float = 0.1
    base: float | None = field(default=None, init=False)
    draft_per_token: float | None = field(default=None, init=False)
    shape: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.top = max(self.gamma_max, self.max_rows - 1)  # the largest k (rows - 1) the curve covers
        self.shape = [verify_shape(k, self.verify_slope) for k in range(self.top + 1)]
        # step_curve's answers while the curve stands: a batch's sequences each price their draft at much the same
        # rows before any of them is timed (seed and update start it anew; base and the draft cost are its key)
        self._curves: dict[tuple, list[float]] = {}

    @property
    def ready(self) -> bool:
        """Both a draft and a verification have been timed."""
        return self.base is not None and self.draft_per_token is not None

    def seed(self, verify_s: Sequence[float]) -> None:
        """Starts the verification curve from measured seconds of verifying k = 0, 1, ... drafted tokens
        (made non-decreasing: more rows never cost less, a dip is timing noise) and forgets the draft cost.

        The kernel's jumps (e.g. a second pass over the weights past 6 rows) are then known before any
        request has drafted that far.
        """
        if not verify_s or min(verify_s) <= 0:
            raise ValueError(f"seed needs positive verification seconds, got {list(verify_s)}")
        curve = list(itertools.accumulate(verify_s[:self.top + 1], max))
        self._curves.clear()
        self.base = curve[0]
        self.shape[:len(curve)] = [t / curve[0] for t in curve]
        # Past the measured k: the last measured slope.
        for k in range(len(curve), self.top + 1):
            self.shape[k] = self.shape[k - 1] + (self.shape[k - 1] - self.shape[k - 2] if k >= 2 else self.verify_slope)
        self.draft_per_token = None

    def update(self, drafted: int, draft_s: float, verify_s: float, draft_timed: bool = True,
               others: int = 0) -> None:
        """Learns from one step; ``draft_timed`` False: a step whose drafting time includes catching up on tokens
        the drafter missed while speculation was off, an upper bound of the draft cost, learnt only where it is
        below the estimate (one slow draft, a host's hiccup, must not stay in the estimate while speculation is
        off: no draft is timed then but these); ``others``: rows other sequences had in the same forward."""
        k = drafted + others
        self._curves.clear()
        if k <= self.top:
            if self.base is not None:  # a hiccup of the host (a pause, a preempted thread) counts as OUTLIER x expected
                expected = self.base * self.shape[k]
                verify_s = min(max(verify_s, expected / OUTLIER), expected * OUTLIER)
            self.base = smoothed(self.base, verify_s / self.shape[k], self.smoothing)
            if k and not others:  # shape[0] stays 1: base is one row's cost, which pins the curve's scale
                self.shape[k] += self.shape_smoothing * (verify_s / self.base - self.shape[k])
        if drafted and (draft_timed or (self.draft_per_token is not None and draft_s / drafted < self.draft_per_token)):
            self.draft_per_token = smoothed(self.draft_per_token, draft_s / drafted, self.smoothing)

    def verify_s(self, k: int) -> float:
        """Seconds of a forward of k + 1 rows (past the curve, its last point and the mean row's cost per row)."""
        if k <= self.top:
            return self.base * self.shape[k]
        mean_row = max(self.shape[self.top] - self.shape[0], 0.0) / max(self.top, 1)
        return self.base * (self.shape[self.top] + (k - self.top) * mean_row)

    def step_s(self, k: int, others: int = 0) -> float:
        """Seconds of a step that drafts k tokens and verifies them, with ``others`` rows of other sequences
        in the same forward."""
        return k * self.draft_per_token + self.verify_s(k + others)

    def step_curve(self, k_max: int, others: int = 0) -> list[float]:
        """[step_s(0, others) .. step_s(k_max, others)] in one pass (a controller's every step reads it; the list is
        shared: read it, do not change it)."""
        key = (k_max, others, self.base, self.draft_per_token)
        curve = self._curves.get(key)
        if curve is None:
            curve = self._curves[key] = self._step_curve(k_max, others)
        return curve

    def _step_curve(self, k_max: int, others: int) -> list[float]:
        base, shape, top, per_token = self.base, self.shape, self.top, self.draft_per_token
        out = [base * shape[k + others] for k in range(0, max(0, min(k_max, top - others) + 1))]
        if len(out) <= k_max:  # past the curve: its last point and the mean row's cost per row
            mean_row = max(shape[top] - shape[0], 0.0) / max(top, 1)
            out += [base * (shape[top] + (k + others - top) * mean_row) for k in range(len(out), k_max + 1)]
        return [v + k * per_token for k, v in enumerate(out)]


@dataclass
class SharedEstimates:
    """What an engine's requests pass on to the next ones: the step costs (the hardware's and the
    models', not the request's), the drafter's long-run acceptance, from which each request's own
    estimate starts (a request of 64 tokens holds too few drafts to judge a drafter from scratch), and
    the measured speed of drafting steps relative to plain ones (``adaptive``'s on/off evidence).

    Args:
        gamma_max: longest draft tracked.
        max_rows: most rows one forward holds (see :class:`StepCosts`; 0 = one sequence's).
        decay: weight kept by older long-run acceptance evidence at each drafting step (slow: it spans requests).
        gain_smoothing: share of the evidence in ``gain`` forgotten at each step.
        gain_prior: ``gain`` assumed before evidence (optimistic, so that drafting gets tried).
        prior_steps: weight of ``gain_prior``, in drafting steps.
        plain_smoothing: weight of the newest plain step in ``plain_s``.
    """

    gamma_max: int
    max_rows: int = 0
    decay: float = 0.99
    gain_smoothing: float = 0.05
    gain_prior: float = 1.2
    prior_steps: float = 3.0
    plain_smoothing: float = 0.1
    costs: StepCosts = field(init=False)
    acceptance: PositionAcceptance = field(init=False)
    plain_s: float | None = field(default=None, init=False)
    plain_age: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.costs = StepCosts(self.gamma_max, self.max_rows)
        self.acceptance = PositionAcceptance(self.gamma_max, decay=self.decay)
        # The prior is evidence like any other: it fades as steps pass (gain itself does not drift with age).
        self._gain_tokens = self.prior_steps * self.gain_prior
        self._gain_steps = self.prior_steps

    def learn_plain(self, seconds: float) -> None:
        """Counts a measured plain step (nothing drafted): the time unit of :attr:`gain`.

        Measured rather than taken from the verification curve: while every step drafts, the curve's
        base and its shape cannot be told apart, and a curve timed at warm-up that underrates v(k) then
        overrates drafting (self-speculation on SmolLM2, which never pays, stayed on at 0.96x plain
        decoding).
        """
        self.plain_s = smoothed(self.plain_s, seconds, self.plain_smoothing)
        self.plain_age = 0

    def learn_gain(self, tokens: int = 0, seconds: float = 0.0) -> None:
        """Ages the evidence by one step and counts the step's ``tokens`` emitted in ``seconds`` (none for
        a plain step: evidence ages with time, so that a probe after a long plain stretch counts)."""
        keep = 1.0 - self.gain_smoothing
        self._gain_tokens = keep * self._gain_tokens + tokens
        unit = self.plain_s if self.plain_s is not None else self.costs.verify_s(0)
        self._gain_steps = keep * self._gain_steps + (seconds / unit if seconds else 0.0)
        self.plain_age += tokens > 0

    @property
    def gain(self) -> float:
        """Drafting steps' speed relative to plain decoding: decayed tokens over decayed plain-step
        equivalents of their time (a ratio of sums, steadier than an average of one-step ratios, which
        swing from 0.4 to 1.7 on the Qwen pair), starting from ``gain_prior``. A plain step's time is
        ``plain_s`` once one was measured (``plain_age`` counts the drafting steps since)."""
        return self._gain_tokens / self._gain_steps

    def request_acceptance(self) -> PositionAcceptance:
        """A request's own acceptance estimate, its priors the long-run estimates."""
        return PositionAcceptance(self.gamma_max, prior=self.acceptance.pooled, later_prior=self.acceptance.later)


def best_gamma(cumulative: list[float], costs: StepCosts, margin: float = 0.0, others_rows: int = 0,
               others_tokens: float = 0.0) -> int:
    """The k in 0..len(cumulative) with the most expected tokens per second, E(k) / step_s(k).

    E(k) = 1 + P_1 + ... + P_k: the target's own token plus each drafted token that is accepted along
    with all before it. Ties go to the shorter draft; a draft must beat plain decoding by ``margin``
    (a share of its rate) to be chosen at all. In a batch the step is shared: the rate is the batch's,
    (others_tokens + E(k)) / step_s(k, others_rows), so a draft must also pay for slowing the others.
    """
    steps = costs.step_curve(len(cumulative), others_rows)
    plain_rate = (others_tokens + 1.0) / steps[0]
    best, best_rate, tokens = 0, plain_rate * (1.0 + margin), 1.0
    for k, prob in enumerate(cumulative, start=1):
        tokens += prob
        rate = (others_tokens + tokens) / steps[k]
        if rate > best_rate:
            best, best_rate = k, rate
    return best
