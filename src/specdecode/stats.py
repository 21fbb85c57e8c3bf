"""Per-request counters and the figures derived from them.

It only counts and derives; it does not time anything itself (the engine passes durations in) and it
does not choose gamma (see ``control/``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def token_acceptance(accepted: int, rejections: int) -> float:
    """Per-token acceptance a estimated from stop-at-first-rejection steps: accepted / (accepted + rejections).

    Tokens drafted after the first rejection are never examined, so accepted / drafted understates a;
    this is the maximum-likelihood estimate of a geometric acceptance process.
    """
    seen = accepted + rejections
    return accepted / seen if seen else 0.0


def expected_tokens_per_step(acceptance: float, gamma: float) -> float:
    """Expected tokens per target forward with i.i.d. acceptance ``a`` and ``gamma`` drafted: (1 - a^(k+1)) / (1 - a)."""
    if acceptance >= 1.0:
        return gamma + 1.0
    return (1.0 - acceptance ** (gamma + 1.0)) / (1.0 - acceptance)


def predicted_speedup(acceptance: float, gamma: float, draft_cost: float, verify_cost: float) -> float:
    """Speedup over plain decoding: E / (k * c + v(k)).

    Args:
        acceptance: per-token acceptance rate a.
        gamma: tokens drafted per step k.
        draft_cost: c, one draft step relative to one plain target step.
        verify_cost: v(k), one verification forward relative to one plain target step.
    """
    return expected_tokens_per_step(acceptance, gamma) / (gamma * draft_cost + verify_cost)


@dataclass
class RequestStats:
    """What happened while serving one request.

    ``target_forwards`` counts decode-phase forwards of the target (one per step: each verifies a draft,
    or decodes one token when nothing was drafted); the prompt's prefill is counted in ``prefill_s``.
    """

    prompt_tokens: int = 0
    tokens_generated: int = 0
    target_forwards: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rejections: int = 0  # steps that stopped at a rejected draft token
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    # Seconds in the gamma controller's decisions; its early-stop calls are also inside draft_s.
    control_s: float = 0.0
    wall_s: float = 0.0
    # One single-token target forward, measured by the engine; needed for the predicted speedup.
    decode_step_s: float | None = None
    # KV memory at the end of the request (bytes held for the sequence, and per token it holds); the draft's
    # figures count the drafter's own cache only (0 for ngram, and for layerskip, which writes into the target's).
    kv_bytes: int = 0
    kv_bytes_per_token: float = 0.0
    draft_kv_bytes: int = 0
    draft_kv_bytes_per_token: float = 0.0
    prefix_hit_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # A request's prediction (``drafters/prediction.py``): its length in tokens, its tokens drafted, those accepted.
    prediction_tokens: int = 0
    prediction_drafted: int = 0
    prediction_accepted: int = 0
    # A grammar's forced tokens drafted and accepted (``drafters/forced.py``; also counted in drafted/accepted), and
    # the seconds its masks took (inside verify_s).
    forced_drafted: int = 0
    forced_accepted: int = 0
    grammar_s: float = 0.0
    # Token trees: steps whose draft branched, and per draft size (nodes, 0 = nothing drafted) the steps and
    # the tokens they accepted.
    tree_steps: int = 0
    steps_by_budget: list[int] = field(default_factory=list)
    accepted_by_budget: list[int] = field(default_factory=list)

    def record_step(self, drafted: int, accepted: int, emitted: int, depth: int | None = None) -> None:
        """Counts one draft-verify step.

        Args:
            drafted: tokens (tree nodes) drafted.
            accepted: drafted tokens kept.
            emitted: tokens the step added to the output.
            depth: a tree's depth when the draft branched (its levels count by position); None for a chain.
        """
        self.target_forwards += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        levels = drafted if depth is None else depth
        self.rejections += accepted < levels
        self.tree_steps += depth is not None
        self.tokens_generated += emitted
        while len(self.drafted_by_position) < levels:
            self.drafted_by_position.append(0)
            self.accepted_by_position.append(0)
        for i in range(levels):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += i < accepted
        while len(self.steps_by_budget) <= drafted:
            self.steps_by_budget.append(0)
            self.accepted_by_budget.append(0)
        self.steps_by_budget[drafted] += 1
        self.accepted_by_budget[drafted] += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def token_acceptance(self) -> float:
        """Per-token acceptance a (see :func:`token_acceptance`): what the speedup formula needs."""
        return token_acceptance(self.accepted_tokens, self.rejections)

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens emitted per target forward, the correction/bonus token included."""
        return self.tokens_generated / self.target_forwards if self.target_forwards else 0.0

    @property
    def mean_gamma(self) -> float:
        return self.drafted_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Of the steps that drafted a token at position i, the share that accepted it."""
        return [a / d for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def accepted_length_by_budget(self) -> list[float | None]:
        """Per draft size (tokens or tree nodes), the mean tokens its steps emitted (None where none ran)."""
        return [(a + s) / s if s else None for a, s in zip(self.accepted_by_budget, self.steps_by_budget)]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_generated / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def predicted_speedup(self) -> float | None:
        """The speedup formula E / (k*c + v(k)) fed with this request's measured acceptance and costs (None without a step time)."""
        if not self.decode_step_s or not self.target_forwards:
            return None
        if not self.drafted_tokens:
            return 1.0
        draft_cost = self.draft_s / self.drafted_tokens / self.decode_step_s
        verify_cost = self.verify_s / self.target_forwards / self.decode_step_s
        return predicted_speedup(self.token_acceptance, self.mean_gamma, draft_cost, verify_cost)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON view: raw counters plus derived figures."""
        out = {k: v for k, v in self.__dict__.items()}
        for name in ("acceptance_rate", "token_acceptance", "mean_accepted_length", "mean_gamma", "acceptance_by_position",
                     "accepted_length_by_budget", "tokens_per_s", "predicted_speedup"):
            out[name] = getattr(self, name)
        return out
