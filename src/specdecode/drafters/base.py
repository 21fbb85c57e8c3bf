"""The drafter protocol: propose k tokens (with a confidence signal per token), then be told what was kept.

A drafter never verifies and never touches the target's output; it only proposes. It may keep its own
state (a KV cache of a draft model) and must roll that state back in ``commit``. It does not decide how
far to draft: it drafts k tokens unless the ``stop`` it is handed says enough (see ``control/``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import torch

from specdecode import tree
from specdecode.kv.cache import Cache, CacheConfig
from specdecode.kv.memory import KVMemory
from specdecode.models.rows import LogitRows
from specdecode.sampling import SamplingParams, argmax_ids, probs_from_logits, sample

if TYPE_CHECKING:
    from specdecode.heads.vocab import DraftVocab

Signal = tuple[float, ...]
# Called after each drafted token with its position (0-based) and signal; True ends the draft there.
StopRule = Callable[[int, Signal], bool]
MODEL_SIGNALS = ("top1", "entropy")


@dataclass
class Draft:
    """Proposed tokens.

    Args:
        tokens: up to k token ids (fewer, even none, when the drafter has nothing to say).
        q: ``[len(tokens), V]`` the distributions the tokens were drawn from, processed like the
            target's (same temperature/top-k/top-p); None when the drafter is deterministic (one-hot q).
        signals: per token, the drafter's confidence signals (named by ``Drafter.signal_names``);
            filled only when ``propose`` was given a stop rule; the forced tokens have none.
        parents: a token tree (``tree.py``): each token's parent, an earlier token or -1 for the sequence's
            last token; None for a chain. A stochastic tree's ``q[i]`` is the distribution token i and its
            siblings were drawn from, without replacement.
        forced: how many of the first tokens a grammar forced (``drafters/forced.py``), not the drafter's choice.
    """

    tokens: list[int]
    q: torch.Tensor | None = None
    signals: list[Signal] = field(default_factory=list)
    parents: list[int] | None = None
    forced: int = 0

    def check(self, budget: int, drafter: str) -> "Draft":
        """Itself, once checked against the ``budget`` the drafter was given and, for a tree, its shape.

        Raises:
            ValueError: more tokens than the budget, or a malformed tree (named, with the drafter).
        """
        if len(self.tokens) > budget:
            raise ValueError(f"drafter {drafter!r} proposed {len(self.tokens)} tokens for a budget of {budget}")
        if self.parents is not None:
            try:
                tree.check_tree(self.tokens, self.parents)
            except ValueError as err:
                raise ValueError(f"drafter {drafter!r}: {err}") from None
        return self

    @property
    def tree_depth(self) -> int | None:
        """The depth of a draft that branches; None for a chain (a tree of width 1 included)."""
        if self.parents is None or tree.is_chain(self.parents):
            return None
        return max(tree.depths(self.parents))

    def row_parents(self, offset: int = 0) -> list[int] | None:
        """Parents of the rows ``[last token, tokens...]`` when they follow ``offset`` other rows of the same
        sequence in a forward (``Transformer.forward_rows``); None for a chain."""
        if self.parents is None:
            return None
        return [offset - 1] + [p + 1 + offset for p in self.parents]


class Drafter(Protocol):
    """``name`` identifies the drafter (and its model in a controller file); ``signal_names`` names the
    floats of each token's signal.

    A drafter that reads the target's features (trained heads) names the layers it wants in
    ``feature_layers`` (see ``Transformer.forward``), and the engine calls ``observe(position, features
    [T, F])`` after ``reset`` with the prompt's features and after every verification with the kept rows'.
    ``weight_nbytes`` and ``own_cache`` say what it holds besides the target (memory reports).
    :class:`DrafterBase` gives the defaults.
    """

    name: str
    signal_names: tuple[str, ...]
    feature_layers: tuple[int, ...]
    weight_nbytes: int
    own_cache: Cache | None

    def observe(self, position: int, features: torch.Tensor) -> None:
        """Features of verified positions (drafters with ``feature_layers`` only)."""

    def reset(self, target_cache: Cache, prompt: Sequence[int] = (), memory: KVMemory | None = None,
              slot: int = 0) -> None:
        """Starts a new request (timed as prefill): ``target_cache`` is the cache the target verifies
        with and ``slot`` the request's slot in it (layerskip drafts there), ``prompt`` the request's token
        ids, for drafters that prefill their own state, ``memory`` the engine's KV budget and prefix caches,
        where a drafter with a cache of its own allocates it."""

    def propose(self, seq: list[int], k: int, sampling: SamplingParams, generator: torch.Generator,
                stop: StopRule | None = None) -> Draft:
        """Proposes up to ``k`` tokens to follow ``seq`` (prompt + accepted tokens).

        Args:
            seq: prompt + accepted tokens.
            k: most tokens to propose.
            sampling: the request's sampling parameters.
            generator: the request's random generator.
            stop: when given, the drafter computes each token's signal, calls ``stop(position, signal)``
                after it and ends the draft (that token included) when it returns True.
        """

    def commit(self, seq: list[int]) -> None:
        """Told the sequence after verification (the previous seq + accepted draft + one target token)."""

    def long_run(self) -> int:
        """Tokens it could draft now from a long, trusted source; 0 when none (see ``DrafterBase.long_run``)."""

    def finish(self, seq: list[int]) -> None:
        """The request ended with ``seq`` (prompt + output) (see ``DrafterBase.finish``)."""

    def learned(self) -> tuple[int, int]:
        """(requests, bytes) it keeps from finished requests (see ``DrafterBase.learned``)."""

    def forget(self) -> None:
        """Drops what it learnt from earlier requests (see ``DrafterBase.forget``)."""

    def name_cache(self, name: str) -> None:
        """Names its own KV cache in the engine's memory (see ``DrafterBase.name_cache``)."""


class DrafterBase:
    """The optional parts of the :class:`Drafter` protocol, with what a drafter that needs none of them says:
    no target features wanted, no weights or KV cache of its own."""

    feature_layers: tuple[int, ...] = ()
    signal_names: tuple[str, ...] = ()  # no confidence signals: the ``confidence`` controller has nothing to read
    # It may be asked to draft after tokens not yet verified (a grammar's forced tokens, ``drafters/forced.py``):
    # true of drafters that read only the tokens they are handed and roll back whatever they fed in ``commit``.
    drafts_past_unverified: bool = False

    def observe(self, position: int, features: torch.Tensor) -> None:
        """Features ``[T, F]`` of the target's verified positions position..position+T-1 (only called for
        drafters with ``feature_layers``)."""

    def reset(self, target_cache: Cache, prompt: Sequence[int] = (), memory: KVMemory | None = None,
              slot: int = 0) -> None:
        """Starts a new request; a drafter that keeps nothing per request has nothing to do."""

    def commit(self, seq: list[int]) -> None:
        """Told the verified sequence; a drafter that feeds nothing ahead of verification has nothing to roll back."""

    @property
    def weight_nbytes(self) -> int:
        """Bytes of weights it holds besides the target's."""
        return 0

    @property
    def own_cache(self) -> Cache | None:
        """Its own KV cache (not the target's), if it keeps one."""
        return None

    def name_cache(self, name: str) -> None:
        """Names its own KV cache in the engine's KV memory (a batch gives each slot's its own name); nothing to
        do for a drafter without one."""

    def long_run(self) -> int:
        """Tokens it could draft now from a long, trusted source (a prediction it follows, a long suffix match),
        known after ``reset``/``commit``; 0 when it has none. The engine may then draft past the controller's
        ``gamma_max``, up to ``SpeculativeConfig.long_max`` (``control/long.py``)."""
        return 0

    def finish(self, seq: list[int]) -> None:
        """The request it served ended with ``seq`` (prompt + output); drafters that learn across requests
        take it here (called once per request, before the next ``reset``)."""

    def learned(self) -> tuple[int, int]:
        """What it keeps from finished requests (``finish``), shared with the other slots' drafters: (requests,
        bytes); (0, 0) when it learns nothing across requests."""
        return 0, 0

    def forget(self) -> None:
        """Drops what it learnt from earlier requests (finished outputs, how its sources fared), shared with the
        other slots' drafters: later requests draft as on a fresh engine. One that learns nothing has nothing to
        drop."""


class DrafterWrapper(DrafterBase):
    """A drafter that drafts in front of another (``wrapped``; None: nothing behind it) and hands every other part
    of the protocol on to it: name, signals, features, weights, cache, ``observe``, ``reset``, ``commit``,
    ``long_run``, ``finish``, ``learned``, ``forget``, ``name_cache``. A subclass sets ``wrapped`` (a dataclass
    field), overrides ``propose``, and calls ``super()`` where it adds to the rest."""

    wrapped: Drafter | None = None
    alone_name = "none"  # its name when it wraps nothing

    @property
    def name(self) -> str:
        return self.wrapped.name if self.wrapped is not None else self.alone_name

    @property
    def signal_names(self) -> tuple[str, ...]:
        return self.wrapped.signal_names if self.wrapped is not None else ()

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.wrapped.feature_layers if self.wrapped is not None else ()

    @property
    def weight_nbytes(self) -> int:
        return self.wrapped.weight_nbytes if self.wrapped is not None else 0

    @property
    def own_cache(self) -> Cache | None:
        return self.wrapped.own_cache if self.wrapped is not None else None

    def name_cache(self, name: str) -> None:
        if self.wrapped is not None:
            self.wrapped.name_cache(name)

    def observe(self, position: int, features: torch.Tensor) -> None:
        if self.wrapped is not None:
            self.wrapped.observe(position, features)

    def reset(self, target_cache: Cache, prompt: Sequence[int] = (), memory: KVMemory | None = None,
              slot: int = 0) -> None:
        if self.wrapped is not None:
            self.wrapped.reset(target_cache, prompt, memory, slot)

    def commit(self, seq: list[int]) -> None:
        if self.wrapped is not None:
            self.wrapped.commit(seq)

    def long_run(self) -> int:
        return self.wrapped.long_run() if self.wrapped is not None else 0

    def finish(self, seq: list[int]) -> None:
        if self.wrapped is not None:
            self.wrapped.finish(seq)

    def learned(self) -> tuple[int, int]:
        return self.wrapped.learned() if self.wrapped is not None else (0, 0)

    def forget(self) -> None:
        if self.wrapped is not None:
            self.wrapped.forget()


class OwnCache(DrafterBase):
    """For drafters with a KV cache of their own (a draft model, an EAGLE head): ``cache_config`` says its
    kind, and ``_claim_cache`` sizes it like the target's (the draft never holds more tokens than the target
    verifies) under the engine's KV budget, reusing it across requests while it fits."""

    cache_config: CacheConfig
    cache: Cache | None = None
    _memory: KVMemory | None = None
    cache_name: str = "draft"  # its name in the KV memory (a batch gives each slot's drafter its own)

    @property
    def own_cache(self) -> Cache | None:
        return self.cache

    def name_cache(self, name: str) -> None:
        self.cache_name = name

    def _claim_cache(self, model, target_cache: Cache, memory: KVMemory | None) -> KVMemory:
        """Empties slot 0 of the cache (allocated for ``model`` when missing, too small, or under another
        budget) and returns the KV memory it lives in."""
        if memory is None:
            memory = self._memory or KVMemory()
        if self.cache is None or self.cache.max_len < target_cache.max_len or memory is not self._memory:
            config = replace(self.cache_config, max_len=target_cache.max_len)
            self.cache, self._memory = memory.new_cache(self.cache_name, model, config), memory
        self.cache.reset(0)
        return memory


def draw(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator,
         subset: DraftVocab | None = None) -> tuple[int, torch.Tensor | None]:
    """Picks one draft token from ``logits [V]``: argmax when greedy (q is one-hot, returned as None),
    else a sample from the same processed distribution the target uses, returned as q ``[V]``.

    ``subset`` (a ``heads.vocab.DraftVocab``) means ``logits`` cover only its ids: a greedy pick never builds the
    whole row (over a ``VocabHead``'s sorted ids the first maximum is the same token), a sample does.
    """
    if sampling.greedy:
        i = int(argmax_ids(logits))
        return (i if subset is None else int(subset.ids[i])), None
    q = probs_from_logits(logits if subset is None else subset.full(logits), sampling)
    return int(sample(q[None], generator)), q


def confidence(logits: torch.Tensor) -> Signal:
    """MODEL_SIGNALS of one ``logits [V]`` row at temperature 1: top-1 probability and entropy (nats);
    -inf entries (tokens outside a draft vocabulary) have probability 0 and add nothing, so a draft
    vocabulary's own row gives the same signals as the whole one."""
    logp = torch.log_softmax(logits.float(), -1)
    p = logp.exp()
    return float(p.max()), float(-torch.where(p > 0, p * logp, 0.0).sum())


def chain_draft(logits: torch.Tensor, advance: Callable[[int], torch.Tensor], k: int, sampling: SamplingParams,
                generator: torch.Generator, stop: StopRule | None = None, subset: DraftVocab | None = None) -> Draft:
    """Draws up to ``k`` tokens one after another: from ``logits [V]``, then from ``advance(token)``, the
    drafter's logits after it has taken the token just drawn (called only while more tokens are due).

    Args:
        logits: the first token's logits over the whole vocabulary (-inf where it may not be drafted), or
            over ``subset``'s ids only.
        advance: feeds a drawn token to the drafter and returns the next token's logits.
        k: tokens to draft (>= 1).
        sampling: the request's sampling parameters.
        generator: the request's random generator.
        stop: the early-stop rule (see ``Drafter.propose``); signals are MODEL_SIGNALS.
        subset: a draft vocabulary the logits are restricted to (see ``draw``), or None.
    """
    tokens, qs, signals = [], [], []
    for i in range(k):
        token, q = draw(logits, sampling, generator, subset)
        tokens.append(token)
        qs.append(q)
        if stop is not None:
            signals.append(confidence(logits))
            if stop(i, signals[-1]):
                break
        if i + 1 < k:
            logits = advance(token)
    return Draft(tokens, None if sampling.greedy else torch.stack(qs), signals)


def model_draft(model, cache: Cache, fed: list[int], k: int, sampling: SamplingParams,
                generator: torch.Generator, layers=None, stop: StopRule | None = None, slot: int = 0,
                vocab: DraftVocab | None = None) -> Draft:
    """Autoregressive drafting with a transformer over its cache.

    Args:
        model: a :class:`~specdecode.models.transformer.Transformer`.
        cache: the cache it reads and appends to, in ``slot``.
        fed: tokens not yet in the cache (at least the last token of the sequence).
        k: tokens to draft (>= 1).
        sampling: the request's sampling parameters.
        generator: the request's random generator (on the model's device).
        layers: layers to run (None = all).
        stop: the early-stop rule (see ``Drafter.propose``); signals are MODEL_SIGNALS.
        slot: the sequence's slot in ``cache``.
        vocab: a draft vocabulary whose output head scores the drafts instead of the model's whole head.
    """
    device, slots = model.device, (slot,)

    def logits_after(tokens: list[int]) -> torch.Tensor:  # [V], or [Vd] over ``vocab``'s ids
        x = torch.tensor([tokens], device=device)
        if vocab is None:
            return model(x, cache, slots, layers=layers, logits=LogitRows.LAST).logits[0, -1]
        state = model(x, cache, slots, layers=layers, logits=LogitRows.NONE, features=(model.config.num_layers,))
        return vocab(state.features[0, -1])

    return chain_draft(logits_after(fed), lambda token: logits_after([token]), k, sampling, generator, stop, vocab)
