"""Online estimates the cost-aware controllers share: per-position acceptance, step costs, expected rate.

Plain Python on a few floats (no tensors): they run on every step. They do not choose gamma.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PositionAcceptance:
    """Per-position conditional acceptance p_i = P(draft token i accepted | the tokens before it were).

    Exponentially decayed counts; each position's estimate leans on the pooled estimate of all positions
    (``strength`` pseudo-counts), and the pooled one on ``prior``, so that rarely reached positions stay sane.

    Args:
        gamma_max: positions tracked.
        prior: acceptance assumed before any evidence.
        decay: weight kept by older evidence at each drafting step.
        strength: pseudo-counts of the pooled (and prior) estimate.
    """

    gamma_max: int
    prior: float = 0.6
    decay: float = 0.9
    strength: float = 2.0
    seen: list[float] = field(init=False)
    hits: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.seen = [0.0] * self.gamma_max
        self.hits = [0.0] * self.gamma_max

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

    @property
    def pooled(self) -> float:
        """Acceptance over all positions, leaning on ``prior``."""
        return (sum(self.hits) + self.strength * self.prior) / (sum(self.seen) + self.strength)

    def cumulative(self, k: int) -> list[float]:
        """[P_1..P_k]: P_i = p_1 * ... * p_i, the chance that the first i drafted tokens are all accepted."""
        pooled = self.pooled
        out, prob = [], 1.0
        for i in range(min(k, self.gamma_max)):
            prob *= (self.hits[i] + self.strength * pooled) / (self.seen[i] + self.strength)
            out.append(prob)
        return out


def verify_shape(k: int, slope: float) -> float:
    """Prior verification cost of k drafted tokens relative to a plain step: 1 + slope * k.

    Where plain steps run two rows (outside the tiled kernel, see ``Engine._verify``) k = 0 really costs
    about what k = 1 does; the learnt curve corrects that once a plain step has run.
    """
    return 1.0 + slope * k


@dataclass
class StepCosts:
    """Online step costs in seconds: drafting per token, and verification by the number of tokens verified.

    Verification is ``base * shape[k]``: ``base`` follows every step quickly (costs drift as the context
    grows), ``shape`` (starting from :func:`verify_shape`) learns the curve v(k) slowly from the k that ran.

    Args:
        gamma_max: longest draft tracked.
        verify_slope: prior extra verification cost per drafted token, relative to a plain step
            (torch on CPU: verifying 8 tokens costs about 1.13 plain steps, see DESIGN.md).
        smoothing: weight of the newest step in ``base`` and the draft cost.
        shape_smoothing: weight of the newest step in ``shape``.
    """

    gamma_max: int
    verify_slope: float = 0.02
    smoothing: float = 0.3
    shape_smoothing: float = 0.1
    base: float | None = field(default=None, init=False)
    draft_per_token: float | None = field(default=None, init=False)
    shape: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.shape = [verify_shape(k, self.verify_slope) for k in range(self.gamma_max + 1)]

    @property
    def ready(self) -> bool:
        """Both a draft and a verification have been timed."""
        return self.base is not None and self.draft_per_token is not None

    def update(self, drafted: int, draft_s: float, verify_s: float, draft_timed: bool = True) -> None:
        """Learns from one step; ``draft_timed`` False leaves the draft cost out (a step whose drafting
        time includes catching up on tokens the drafter missed while speculation was off)."""
        k = min(drafted, self.gamma_max)
        seen = verify_s / self.shape[k]
        self.base = seen if self.base is None else self.base + self.smoothing * (seen - self.base)
        self.shape[k] += self.shape_smoothing * (verify_s / self.base - self.shape[k])
        if drafted and draft_timed:
            per = draft_s / drafted
            self.draft_per_token = per if self.draft_per_token is None else (
                self.draft_per_token + self.smoothing * (per - self.draft_per_token))

    def verify_s(self, k: int) -> float:
        return self.base * self.shape[min(k, self.gamma_max)]

    def step_s(self, k: int) -> float:
        """Seconds of a step that drafts k tokens and verifies them."""
        return k * self.draft_per_token + self.verify_s(k)


def best_gamma(cumulative: list[float], costs: StepCosts, margin: float = 0.0) -> int:
    """The k in 0..len(cumulative) with the most expected tokens per second, E(k) / step_s(k).

    E(k) = 1 + P_1 + ... + P_k: the target's own token plus each drafted token that is accepted along
    with all before it. Ties go to the shorter draft; a draft must beat plain decoding by ``margin``
    (a share of its rate) to be chosen at all.
    """
    plain_rate = 1.0 / costs.step_s(0)
    best, best_rate, tokens = 0, plain_rate * (1.0 + margin), 1.0
    for k, prob in enumerate(cumulative, start=1):
        tokens += prob
        rate = tokens / costs.step_s(k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best
