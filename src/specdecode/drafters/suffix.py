"""SuffixDecoding (arXiv 2411.04975): draft from suffix tries of the request's prompt and output, and of earlier
requests' outputs.

Each request has a trie (``suffix_tree.py``) of its prompt and output so far, brought up to the accepted tokens
when it is asked to draft (under load most steps draft nothing: a commit only notes the tokens); an engine has one
:class:`SuffixCache` of finished requests' outputs, shared by every slot's drafter and bounded by requests and
bytes (oldest out first). To draft, every tail of the sequence found in either trie (up to ``max_depth`` tokens,
seen at least once before) offers its most frequent continuation, of at most ``ceil(alpha * tail length)`` tokens
(a longer match earns a longer draft), scored by the sum of its tokens' path probabilities (the tokens expected to
be accepted, were the counts the odds); the best one is drafted. A tail of ``LONG_MATCH`` tokens or more whose
continuation stays sure is a long run (``long_run``: the engine may then draft past ``gamma_max``,
``control/long.py``); asked every step, it first looks the last ``LONG_MATCH`` tokens up among the hashes of those
seen before (the request's, the cache's outputs'). Costs no model call and is deterministic (q is one-hot). It does
not match approximately, continue past a trie's depth (a match and its continuation fit in ``max_depth`` tokens),
or keep prompts across requests (as the paper: the prompt is the request's own, and usually far longer than the
output).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdecode.drafters.base import Draft, DrafterBase, StopRule
from specdecode.drafters.registry import SHARED_SUFFIX_CACHE, DrafterInputs, DrafterSpec, Needs, register
from specdecode.drafters.suffix_tree import ROOT, new_trie
from specdecode.kv.cache import Cache
from specdecode.kv.memory import KVMemory
from specdecode.sampling import SamplingParams

SUFFIX_SIGNALS = ("match_len", "count", "prob")
LONG_MATCH = 8  # a tail of at least this many tokens...
LONG_PROB = 0.8  # ...drafts a long run while its continuation stays at least this probable (``long_run``)


@dataclass
class SuffixCache:
    """Finished requests' outputs in one suffix trie, shared by an engine's drafters.

    Args:
        max_requests: most outputs kept; the oldest go first.
        max_bytes: most bytes (the trie's ``nbytes``, an estimate) the trie holds; the oldest go first (even the
            newest, alone past it). The hashes of the outputs' ``LONG_MATCH``-grams come on top, uncounted (a few
            percent of the trie's bytes: one entry a token against one node per token and depth).
        enabled: False keeps nothing: the drafters draft from their own request alone.
        max_depth: the trie's depth.
    """

    max_requests: int = 1000
    max_bytes: int = 256 << 20
    enabled: bool = True
    max_depth: int = 32

    def __post_init__(self) -> None:
        self.trie = new_trie(self.max_depth)
        self.outputs: deque[list[int]] = deque()
        self.version = 0  # changes with each add: a drafter then looks its tail up again (nodes may be freed)
        self.long_grams: Counter[int] = Counter()  # hashes of the outputs' LONG_MATCH-grams (long_run's first check)

    def add(self, tokens: list[int]) -> None:
        """Keeps the output ``tokens``, evicting the oldest outputs past either bound."""
        if not self.enabled or not tokens:
            return
        self.trie.insert(tokens)
        self.long_grams.update(_gram_hashes(tokens))
        self.outputs.append(tokens)
        while self.outputs and (len(self.outputs) > self.max_requests or self.trie.nbytes > self.max_bytes):
            old = self.outputs.popleft()
            self.trie.remove(old)
            for gram in _gram_hashes(old):
                left = self.long_grams[gram] - 1
                if left:
                    self.long_grams[gram] = left
                else:
                    del self.long_grams[gram]
        self.version += 1

    def learned(self) -> tuple[int, int]:
        """(outputs, bytes) kept."""
        return len(self.outputs), self.trie.nbytes

    def clear(self) -> None:
        """Drops every output kept (the drafters look their tails up again: the version changes)."""
        self.trie = new_trie(self.max_depth)
        self.outputs.clear()
        self.long_grams.clear()
        self.version += 1


@dataclass
class _Pick:
    """A continuation of one matched tail: its tokens (parents for a tree), their path probabilities, the
    tail's length and earlier occurrences, and its score."""

    tokens: list[int]
    parents: list[int] | None
    probs: list[float]
    match_len: int
    count: int
    score: float  # the sum of the path probabilities (the tokens expected accepted)


@dataclass
class SuffixDrafter(DrafterBase):
    """Suffix-trie drafting over the request (its own trie) and the engine's :class:`SuffixCache`.

    Its signals (SUFFIX_SIGNALS), per proposed token: the matched tail's length, how many times it occurred
    before (in the trie drafted from), and the token's path probability (the share of those occurrences that
    went on this way up to this token). They cost nothing extra. A tree (``tree``) has no signals; ``k`` is then
    its node budget.

    Args:
        cache: finished requests' outputs (the engine's, shared; a new one when built alone).
        max_depth: depth of the request's own trie.
        alpha: a tail of d tokens drafts at most ``ceil(alpha * d)`` tokens.
        min_prob: a draft ends before a token whose path probability falls below this.
        tree: draft the best tail's most probable continuations as a token tree, not one chain.
    """

    cache: SuffixCache = field(default_factory=SuffixCache)
    max_depth: int = 32
    alpha: float = 1.0
    min_prob: float = 0.1
    tree: bool = False
    name: str = "suffix"

    def __post_init__(self) -> None:
        if self.alpha <= 0 or not 0 <= self.min_prob <= 1:
            raise ValueError(f"suffix needs alpha > 0 and 0 <= min_prob <= 1, got {self.alpha}, {self.min_prob}")
        self._start(())

    @property
    def signal_names(self) -> tuple[str, ...]:
        return () if self.tree else SUFFIX_SIGNALS

    def reset(self, target_cache: Cache, prompt: Sequence[int] = (), memory: KVMemory | None = None,
              slot: int = 0) -> None:
        self._start(prompt)

    def _start(self, prompt: Sequence[int]) -> None:
        """A new request: a trie of ``prompt`` alone."""
        self._trie = new_trie(self.max_depth)
        self._path = [ROOT]  # the sequence's tails in its own trie (the longest ones occur only there, at its end)
        self._seen = self._prompt_len = 0  # tokens in the trie; the prompt's
        self._tail: list[int] = []  # the sequence's last cache.max_depth tokens
        self._version = -1  # the cache's version its tails were looked up in (-1: not yet)
        self._global = [ROOT]  # the sequence's tails in the cache's trie
        self._plan: _Pick | None = None  # long_run's pick, drafted by the next propose
        self._latest: list[int] = list(prompt)  # the longest sequence given to it (the caller's list; tries may lag)
        self._grams: set[int] = set()  # hashes of the sequence's LONG_MATCH-grams
        self._noted = 0  # tokens of the sequence whose grams are in _grams
        self._repeated = False  # its last LONG_MATCH tokens occurred earlier in it too
        self._sync(self._latest)
        self._note(self._latest)
        self._prompt_len = len(prompt)

    def long_run(self) -> int:
        # A long run needs its last LONG_MATCH tokens seen before (here or in the cache): most steps end at that
        # check, and the tries catch up with the sequence only past it (or at the next propose).
        if len(self._latest) != self._noted:  # (the caller's list grew in place since)
            self._note(self._latest)
        if not (self._repeated or (len(self._latest) >= LONG_MATCH
                                   and hash(tuple(self._latest[-LONG_MATCH:])) in self.cache.long_grams)):
            return 0
        self._sync(self._latest)
        pick = self._pick(max(self.max_depth, self.cache.max_depth), shortest=LONG_MATCH)
        if pick is None:
            return 0
        run = next((i for i, p in enumerate(pick.probs) if p < LONG_PROB), len(pick.probs))
        self._plan = pick if run else None
        return run

    def propose(self, seq: list[int], k: int, sampling: SamplingParams, generator: torch.Generator,
                stop: StopRule | None = None) -> Draft:
        if len(seq) > len(self._latest):  # (asked past the last commit: a later long_run must not sync back to it)
            self._latest = seq
            self._note(seq)
        self._sync(seq)
        pick = self._plan or self._pick(k)  # a long run's pick is as good a start for any k
        self._plan = None
        if pick is None or k < 1:
            return Draft([])
        # Cut to k: a tree's nodes come best first, each after its parent, so its first k are a tree.
        tokens = pick.tokens[:k]
        if self.tree:
            return Draft(tokens, parents=pick.parents[:k])
        if stop is None:
            return Draft(tokens)
        signals = [(float(pick.match_len), float(pick.count), p) for p in pick.probs[:k]]
        end = next((i + 1 for i, signal in enumerate(signals) if stop(i, signal)), len(tokens))
        return Draft(tokens[:end], signals=signals[:end])

    def commit(self, seq: list[int]) -> None:
        self._latest = seq  # the tries catch up when next asked to draft or for a long run
        self._note(seq)

    def finish(self, seq: list[int]) -> None:
        self.cache.add(seq[self._prompt_len:])

    def learned(self) -> tuple[int, int]:
        return self.cache.learned()

    def forget(self) -> None:
        self.cache.clear()

    def _note(self, seq: list[int]) -> None:
        """Counts the LONG_MATCH-grams that ``seq``'s new tokens end, noting whether the last one was seen before."""
        grams = self._grams
        for end in range(max(self._noted + 1, LONG_MATCH), len(seq) + 1):
            gram = hash(tuple(seq[end - LONG_MATCH:end]))
            self._repeated = gram in grams
            grams.add(gram)
        self._noted = len(seq)

    def _sync(self, seq: list[int]) -> None:
        """Adds the tokens of ``seq`` not yet seen to the request's trie and follows its tails in the cache."""
        new = seq[self._seen:]
        if not new and self._version == self.cache.version:
            return
        self._path = self._trie.extend_all(self._path, new)
        self._seen, self._tail, self._plan = len(seq), seq[-self.cache.max_depth:], None
        self._look_up(new)

    def _look_up(self, new: list[int]) -> None:
        """Follows the tails in the cache's trie past the ``new`` tokens; after the cache changed, finds them anew."""
        trie = self.cache.trie
        if self._version != self.cache.version:
            self._version, self._global, self._plan = self.cache.version, trie.match(self._tail), None
            return
        self._global = trie.advance_all(self._global, new)

    def _pick(self, budget: int, shortest: int = 1) -> _Pick | None:
        """The best-scoring continuation of at most ``budget`` tokens over both tries' tails of at least ``shortest``
        tokens; None if none."""
        best: _Pick | None = None
        # The sequence's own occurrence of its tails has no continuation yet: it counts 1 less there. The own trie goes
        # first and wins ties (a pick must beat the best so far).
        for trie, path, own in ((self._trie, self._path, 1), (self.cache.trie, self._global, 0)):
            found = trie.pick(path, own, budget, shortest, self.alpha, self.min_prob, self.tree,
                              -math.inf if best is None else best.score)
            if found is not None:
                tokens, parents, probs, match_len, count, score = found
                best = _Pick(tokens, parents if self.tree else None, probs, match_len, count, score)
        return best if best is not None and best.tokens else None


def _build(inputs: DrafterInputs, tree: bool) -> SuffixDrafter:
    # One cache per engine: every slot's drafter is built from the same inputs (a default one where no
    # drafter_setup made it).
    cache = inputs.shared.setdefault(SHARED_SUFFIX_CACHE, SuffixCache())
    return SuffixDrafter(cache, tree=tree, name="suffix-tree" if tree else "suffix")


_FLAGS = ("--suffix-cache-requests", "--suffix-cache-mb", "--no-suffix-cache")
register(DrafterSpec("suffix", lambda i: _build(i, tree=False),
                     "suffix trees over the prompt, the output and earlier requests' outputs (SuffixDecoding)",
                     Needs.SUFFIX_CACHE, flags=_FLAGS))
register(DrafterSpec("suffix-tree", lambda i: _build(i, tree=True),
                     "suffix trees drafting token trees (SuffixDecoding)", Needs.SUFFIX_CACHE, tree=True, flags=_FLAGS))


def _gram_hashes(tokens: list[int]) -> list[int]:
    """Hashes of every LONG_MATCH tokens in a row of ``tokens``."""
    return [hash(tuple(tokens[i:i + LONG_MATCH])) for i in range(len(tokens) - LONG_MATCH + 1)]
