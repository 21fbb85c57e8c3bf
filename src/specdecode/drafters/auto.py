"""``auto``: each step, the draft of whichever free source expects the most accepted tokens.

The sources cost no model call: the suffix tries (the request's own prompt and output, and the engine's cache of
earlier outputs, ``suffix.py``) and prompt lookup (the latest earlier occurrence of the tail, ``ngram.py``). Each
step both propose, and each proposal is scored as the tokens it expects to have accepted: the sum over its
tokens of the share of the matched tail's occurrences that went on that way (suffix's path probabilities,
n-gram's agreeing occurrences), times its source's calibration, the tokens of its drafts accepted over the
tokens they expected (decayed, shared by the engine's slots, so that a source whose counts overrate it learns
so). A long suffix run (``long_run``) goes first. A request's prediction and its grammar's forced tokens come in
front of it, as for every drafter (``chain.py``).

Its signals are suffix's (match length, occurrences, share), the chosen source's. It does not run a draft model,
price a draft (its controller does) or verify.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdecode.drafters.base import Draft, DrafterBase, StopRule
from specdecode.drafters.ngram import NgramDrafter, sizes
from specdecode.drafters.registry import SHARED_SUFFIX_CACHE, DrafterInputs, DrafterSpec, Needs, register
from specdecode.drafters.suffix import SUFFIX_SIGNALS, SuffixCache, SuffixDrafter
from specdecode.kv.cache import Cache
from specdecode.kv.memory import KVMemory
from specdecode.sampling import SamplingParams

AUTO = "auto"  # its --drafter name
SHARED_CALIBRATION = "auto-calibration"  # DrafterInputs.shared's key of the sources' calibration
SOURCES = ("suffix", "ngram")
_SIGNALS_ONLY = lambda position, signal: False  # noqa: E731 (a stop rule that only asks a source for its signals)
_GREEDY = SamplingParams()  # the free sources draft alike at any temperature


@dataclass
class Calibration:
    """Per source, decayed sums of the tokens its drafts expected and those accepted; their ratio scales its
    next proposals' expectations.

    Args:
        decay: weight kept by older drafts at each new one.
        prior: tokens of agreement assumed before any draft (a ratio of 1 until drafts say otherwise).
    """

    decay: float = 0.98
    prior: float = 2.0
    sums: dict[str, list[float]] = field(default_factory=dict)

    def factor(self, source: str) -> float:
        expected, accepted = self.sums.get(source, (self.prior, self.prior))
        return accepted / expected

    def learn(self, source: str, expected: float, accepted: int) -> None:
        sums = self.sums.setdefault(source, [self.prior, self.prior])
        sums[0] = self.decay * sums[0] + expected
        sums[1] = self.decay * sums[1] + accepted


@dataclass
class _Proposal:
    source: str
    tokens: list[int]
    signals: list[tuple[float, ...]]

    @property
    def expected(self) -> float:
        """Tokens expected accepted, were the occurrence counts the odds (each signal's last field is its share)."""
        return sum(signal[-1] for signal in self.signals)


@dataclass
class AutoDrafter(DrafterBase):
    """The best of the free sources, step by step.

    Args:
        cache: finished requests' outputs, the suffix source's (the engine's, shared).
        calibration: the sources' calibration (the engine's, shared).
        min_ngram: shortest tail prompt lookup matches.
        max_ngram: longest tail prompt lookup matches.
        sources: the sources it asks (all of SOURCES by default; fewer to measure one alone).
    """

    cache: SuffixCache = field(default_factory=SuffixCache)
    calibration: Calibration = field(default_factory=Calibration)
    min_ngram: int = 1
    max_ngram: int = 3
    sources: tuple[str, ...] = SOURCES
    name: str = AUTO
    signal_names = SUFFIX_SIGNALS

    def __post_init__(self) -> None:
        if not self.sources or not set(self.sources) <= set(SOURCES):
            raise ValueError(f"auto's sources must be some of {SOURCES}, got {self.sources}")
        self.ngram = NgramDrafter(max_ngram=self.max_ngram, min_ngram=self.min_ngram)  # (refuses bad sizes)
        self.suffix = SuffixDrafter(self.cache)
        self._last: tuple[_Proposal, int] | None = None  # the last draft and where in the sequence it starts
        self._long = False  # the suffix source has a long run for the next draft

    def reset(self, target_cache: Cache, prompt: Sequence[int] = (), memory: KVMemory | None = None,
              slot: int = 0) -> None:
        self.suffix.reset(target_cache, prompt, memory, slot)
        self._last = None

    def long_run(self) -> int:
        run = self.suffix.long_run()
        self._long = run > 0
        return run

    def propose(self, seq: list[int], k: int, sampling: SamplingParams, generator: torch.Generator,
                stop: StopRule | None = None) -> Draft:
        if k < 1:
            return Draft([])
        best = max(self._proposals(seq, k), key=lambda p: p.expected * self.calibration.factor(p.source),
                   default=None)
        if best is None:
            self._last = None
            return Draft([])
        end = len(best.tokens) if stop is None else \
            next((i + 1 for i, signal in enumerate(best.signals) if stop(i, signal)), len(best.tokens))
        tokens, signals = best.tokens[:end], best.signals[:end]
        self._last = (_Proposal(best.source, tokens, signals), len(seq))
        return Draft(tokens, signals=signals if stop is not None else [])

    def _proposals(self, seq: list[int], k: int) -> list[_Proposal]:
        """Each source's proposal of at most ``k`` tokens with its signals (a source with none left out)."""
        out = []
        draft = self.suffix.propose(seq, k, _GREEDY, None, _SIGNALS_ONLY)  # kept in sync whether asked or not
        if draft.tokens and "suffix" in self.sources:
            out.append(_Proposal("suffix", draft.tokens, draft.signals))
        if self._long or "ngram" not in self.sources:  # a long run drafts alone
            self._long = False
            return out
        draft = self.ngram.propose(seq, k, _GREEDY, None, _SIGNALS_ONLY)
        if draft.tokens:
            out.append(_Proposal("ngram", draft.tokens, draft.signals))
        return out

    def commit(self, seq: list[int]) -> None:
        if self._last is not None:
            proposal, start = self._last
            kept = seq[start:start + len(proposal.tokens)]
            accepted = next((i for i, (a, b) in enumerate(zip(kept, proposal.tokens)) if a != b), len(kept))
            self.calibration.learn(proposal.source, proposal.expected, accepted)
            self._last = None
        self.suffix.commit(seq)

    def finish(self, seq: list[int]) -> None:
        self.suffix.finish(seq)

    def learned(self) -> tuple[int, int]:
        return self.suffix.learned()


def _build(inputs: DrafterInputs) -> AutoDrafter:
    # One suffix cache and one calibration per engine: every slot's drafter is built from the same inputs.
    cache = inputs.shared.setdefault(SHARED_SUFFIX_CACHE, SuffixCache())
    calibration = inputs.shared.setdefault(SHARED_CALIBRATION, Calibration())
    return AutoDrafter(cache, calibration, **sizes(inputs))


register(DrafterSpec(AUTO, _build, "the best of the free sources each step: suffix trees (prompt, output, earlier "
                                     "outputs) and prompt lookup, by expected accepted tokens",
                     Needs.SUFFIX_CACHE, flags=("--ngram", "--suffix-cache-requests", "--suffix-cache-mb",
                                                "--no-suffix-cache")))
