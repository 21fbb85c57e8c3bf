"""``auto``: each step, the draft of whichever source expects the most accepted tokens.

The free sources cost no model call: the suffix tries (the request's own prompt and output, and the engine's cache of
earlier outputs, ``suffix.py``) and prompt lookup (the latest earlier occurrence of the tail, ``ngram.py``). Each
step both propose, and each proposal is scored as the tokens it expects to have accepted: the sum over its
tokens of the share of the matched tail's occurrences that went on that way (suffix's path probabilities,
n-gram's agreeing occurrences), times its source's calibration, the tokens of its drafts accepted over the
tokens they expected (decayed, shared by the engine's slots, so that a source whose counts overrate it learns
so). A long suffix run (``long_run``) goes first. A request's prediction and its grammar's forced tokens come in
front of it, as for every drafter (``chain.py``).

With a draft model (``--draft-model``; then named ``auto+draft``) the model drafts whenever the best free proposal
expects fewer accepted tokens than the model's drafts have had accepted on average (decayed, engine-wide): the
free sources cost nothing, so they win ties. Its signals are then the model's (top-1 probability, entropy), a free
token's made from its calibrated share, so that one controller stops both; the model catches up on the tokens it
did not draft at its next draft.

Its signals without a model are suffix's (match length, occurrences, share), the chosen source's. After tokens not
yet verified (a grammar's forced tokens, ``forced.py``) only prompt lookup and the model draft: the suffix tries
hold verified tokens alone. It does not price a draft (its controller does) or verify.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdecode.drafters.base import MODEL_SIGNALS, Draft, DrafterBase, Signal, StopRule
from specdecode.drafters.draft_model import MODEL_FLAGS, DraftModelDrafter, model_drafter
from specdecode.drafters.ngram import NgramDrafter, sizes
from specdecode.drafters.registry import SHARED_SUFFIX_CACHE, DrafterInputs, DrafterSpec, Needs, register
from specdecode.drafters.suffix import SUFFIX_SIGNALS, SuffixCache, SuffixDrafter
from specdecode.heads.vocab import VocabHead
from specdecode.kv.cache import Cache
from specdecode.kv.prefix import common_prefix
from specdecode.kv.memory import KVMemory
from specdecode.sampling import SamplingParams

AUTO = "auto"  # its --drafter name
AUTO_DRAFT = "auto+draft"  # its name with a draft model (its model in a controller file)
MODEL = "model"  # the draft model, as a source
SHARED_CALIBRATION = "auto-calibration"  # DrafterInputs.shared's key of the sources' calibration
SOURCES = ("suffix", "ngram")
_SIGNALS_ONLY = lambda position, signal: False  # noqa: E731 (a stop rule that only asks a source for its signals)
_GREEDY = SamplingParams()  # the free sources draft alike at any temperature


@dataclass
class Calibration:
    """Per source, decayed sums of the tokens its drafts expected and those accepted; their ratio scales its
    next proposals' expectations. The draft model, which expects nothing in advance, counts each draft as one
    token expected: its ratio is the tokens accepted per draft.

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

    def clear(self) -> None:
        """Back to the prior for every source."""
        self.sums.clear()

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
        sources: the free sources it asks (all of SOURCES by default; fewer to measure one alone).
        model: a draft model's drafter (``draft_model.py``), drafting where the free sources expect less; None:
            the free sources alone.
    """

    cache: SuffixCache = field(default_factory=SuffixCache)
    calibration: Calibration = field(default_factory=Calibration)
    min_ngram: int = 1
    max_ngram: int = 3
    sources: tuple[str, ...] = SOURCES
    model: DraftModelDrafter | None = None
    name: str = AUTO
    signal_names: tuple[str, ...] = SUFFIX_SIGNALS
    drafts_past_unverified = True  # with the sources that can (see the module's docstring)

    def __post_init__(self) -> None:
        if not self.sources or not set(self.sources) <= set(SOURCES):
            raise ValueError(f"auto's sources must be some of {SOURCES}, got {self.sources}")
        self.ngram = NgramDrafter(max_ngram=self.max_ngram, min_ngram=self.min_ngram)  # (refuses bad sizes)
        self.suffix = SuffixDrafter(self.cache)
        if self.model is not None:
            self.name, self.signal_names = AUTO_DRAFT, MODEL_SIGNALS
        self._last: tuple[_Proposal, int] | None = None  # the last draft and where in the sequence it starts
        self._long = False  # the suffix source has a long run for the next draft
        self._verified = 0  # tokens of the sequence verified (past them, a proposal follows unverified ones)

    @property
    def weight_nbytes(self) -> int:
        return self.model.weight_nbytes if self.model is not None else 0

    @property
    def own_cache(self) -> Cache | None:
        return self.model.own_cache if self.model is not None else None

    def name_cache(self, name: str) -> None:
        if self.model is not None:
            self.model.name_cache(name)

    @property
    def vocab(self) -> VocabHead | None:
        """Its draft model's draft vocabulary (``draft_model.py``); None without a model or over all tokens."""
        return self.model.vocab if self.model is not None else None

    def reset(self, target_cache: Cache, prompt: Sequence[int] = (), memory: KVMemory | None = None,
              slot: int = 0) -> None:
        self.suffix.reset(target_cache, prompt, memory, slot)
        if self.model is not None:
            self.model.reset(target_cache, prompt, memory, slot)
        self._last = None
        self._verified = len(prompt)

    def long_run(self) -> int:
        run = self.suffix.long_run()
        self._long = run > 0
        return run

    def propose(self, seq: list[int], k: int, sampling: SamplingParams, generator: torch.Generator,
                stop: StopRule | None = None) -> Draft:
        self._last = None
        if k < 1:
            return Draft([])
        past = len(seq) > self._verified  # after unverified tokens: the suffix source (and its long run) sits out
        long = self._long and not past
        score = lambda p: p.expected * self.calibration.factor(p.source)  # noqa: E731
        best = max(self._proposals(seq, k, past), key=score, default=None)
        if self.model is not None and not long and (best is None or score(best) < self.calibration.factor(MODEL)):
            draft = self.model.propose(seq, k, sampling, generator, stop)
            self._last = (_Proposal(MODEL, draft.tokens, []), len(seq))
            return draft
        if best is None:
            return Draft([])
        signals = best.signals if self.model is None else \
            [_model_signal(s[-1] * self.calibration.factor(best.source)) for s in best.signals]
        end = len(best.tokens) if stop is None else \
            next((i + 1 for i, signal in enumerate(signals) if stop(i, signal)), len(best.tokens))
        self._last = (_Proposal(best.source, best.tokens[:end], best.signals[:end]), len(seq))
        return Draft(best.tokens[:end], signals=signals[:end] if stop is not None else [])

    def _proposals(self, seq: list[int], k: int, past: bool) -> list[_Proposal]:
        """Each source's proposal of at most ``k`` tokens with its signals (a source with none left out); ``past``:
        ``seq`` ends in unverified tokens, which the suffix source may not take in."""
        out = []
        if not past:
            draft = self.suffix.propose(seq, k, _GREEDY, None, _SIGNALS_ONLY)  # kept in sync whether asked or not
            if draft.tokens and "suffix" in self.sources:
                out.append(_Proposal("suffix", draft.tokens, draft.signals))
        long, self._long = self._long and not past, False
        if long or "ngram" not in self.sources:  # a long run drafts alone
            return out
        draft = self.ngram.propose(seq, k, _GREEDY, None, _SIGNALS_ONLY)
        if draft.tokens:
            out.append(_Proposal("ngram", draft.tokens, draft.signals))
        return out

    def commit(self, seq: list[int]) -> None:
        if self._last is not None:
            proposal, start = self._last
            accepted = common_prefix(proposal.tokens, seq[start:start + len(proposal.tokens)])
            expected = 1.0 if proposal.source == MODEL else proposal.expected
            self.calibration.learn(proposal.source, expected, accepted)
            self._last = None
        self.suffix.commit(seq)
        if self.model is not None:
            self.model.commit(seq)
        self._verified = len(seq)

    def finish(self, seq: list[int]) -> None:
        self.suffix.finish(seq)

    def learned(self) -> tuple[int, int]:
        return self.suffix.learned()

    def forget(self) -> None:
        self.suffix.forget()
        self.calibration.clear()


def _model_signal(p: float) -> Signal:
    """MODEL_SIGNALS of a free token expected accepted with probability ``p``: as a model sure of it by ``p``
    (top-1 ``p``, the entropy of that yes/no)."""
    p = min(max(p, 1e-6), 1.0 - 1e-6)
    return p, -(p * math.log(p) + (1.0 - p) * math.log(1.0 - p))


def _build(inputs: DrafterInputs) -> AutoDrafter:
    # One suffix cache and one calibration per engine: every slot's drafter is built from the same inputs.
    cache = inputs.shared.setdefault(SHARED_SUFFIX_CACHE, SuffixCache())
    calibration = inputs.shared.setdefault(SHARED_CALIBRATION, Calibration())
    model = model_drafter(inputs, AUTO) if inputs.draft_model is not None else None
    return AutoDrafter(cache, calibration, **sizes(inputs), model=model)


register(DrafterSpec(AUTO, _build, "the best source each step: suffix trees (prompt, output, earlier outputs), "
                                     "prompt lookup and a draft model if given, by expected accepted tokens",
                     Needs.SUFFIX_CACHE, flags=("--ngram", "--suffix-cache-requests", "--suffix-cache-mb",
                                                "--no-suffix-cache", *MODEL_FLAGS), uses=Needs.DRAFT_MODEL))
