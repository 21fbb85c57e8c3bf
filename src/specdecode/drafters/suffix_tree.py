"""A depth-bounded suffix trie with occurrence counts: SuffixDecoding's index (arXiv 2411.04975).

Every suffix of the inserted token sequences, cut to ``max_depth`` tokens, is a path from the root; a node
counts how many times its substring occurred (start positions), so ``count(child) / count(node)`` is how often
the substring went on with the child's token. Sequences are added whole (``insert``) or a token at a time
(``extend``, O(max_depth) per token: it moves the nodes of the sequence's tails down), and removed again
(``remove``) so that a bounded cache can evict its oldest. ``chain`` and ``tree`` propose continuations
from a matched node, scored by that frequency. It knows nothing of drafting (``suffix.py`` does).

Two implementations with the same nodes, ids, counts and choices: ``suffix_trie.cpp``, compiled at first use
(``new_trie`` hands it out; adding a token there costs ~1.2 us instead of ~12), and this module's Python class,
the reference its tests hold the compiled one to and the fallback where nothing compiles. In Python, nodes are
ids into lists, their children dicts of ints: nothing the garbage collector tracks, which would otherwise rescan
the millions of node objects of a large trie and make inserting several times slower. Written here rather than
taken from arctic-inference's C++ tree: that ships only as an sdist whose build needs torch>=2.10, grpcio-tools,
cmake and nanobind and installs a vLLM plugin, not a plain CPU dependency.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from pathlib import Path
from types import ModuleType
from typing import Callable

from specdecode.models.native import compile_extension

ROOT = 0
# Bytes a node costs (its list entries, its children dict, its id in its parent's), measured with tracemalloc
# on tries of text-like sequences under CPython 3.11; ``nbytes`` is this estimate, not a measurement.
NODE_BYTES = 275


class SuffixTrie:
    """The trie of every suffix (cut to ``max_depth`` tokens) of the sequences inserted.

    A *path* is a sequence's tails as nodes: ``path[d]`` is the node of its last d tokens (``ROOT`` at 0), as
    far as they occur here; ``extend`` and ``advance`` take the path before a token and return the path
    after it. ``remove`` frees nodes for reuse, so a path kept across it must be looked up again (``match``).

    Args:
        max_depth: the longest substring counted (and so the longest match plus continuation).
    """

    node_bytes = NODE_BYTES

    def __init__(self, max_depth: int = 32) -> None:
        if max_depth < 1:
            raise ValueError(f"a suffix trie needs max_depth >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.counts = [0]  # node -> occurrences of its substring; the root's: tokens inserted
        self.children: list[dict[int, int] | None] = [None]  # node -> {token: child}, None while it has none
        self.best = [-1]  # node -> its most frequent child's token; -1 while unknown (looked up when asked)
        self._free: list[int] = []  # removed nodes, reused first

    @property
    def nodes(self) -> int:
        """Nodes below the root."""
        return len(self.counts) - 1 - len(self._free)

    @property
    def nbytes(self) -> int:
        """Estimated bytes held (``NODE_BYTES`` per node)."""
        return self.nodes * NODE_BYTES

    @property
    def allocated(self) -> int:
        """Node ids made so far (the root's included; a removed node's id is reused, not made again)."""
        return len(self.counts)

    def node_count(self, node: int) -> int:
        """Occurrences of ``node``'s substring (the root's: tokens inserted)."""
        return self.counts[node]

    def has_children(self, node: int) -> bool:
        return self.children[node] is not None

    def deepest(self, path: list[int], more_than: int) -> int:
        """The depth of ``path``'s deepest node counted more than ``more_than`` times (-1: none is); a path's
        counts never grow with depth (a longer tail occurs no more often than a shorter one)."""
        counts, lo, hi = self.counts, 0, len(path)
        while lo < hi:
            mid = (lo + hi) // 2
            if counts[path[mid]] > more_than:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    def counts_along(self, path: list[int]) -> list[int]:
        """Each node's count, in ``path``'s order."""
        counts = self.counts
        return [counts[node] for node in path]

    def extend(self, path: list[int], token: int) -> list[int]:
        """Appends ``token`` to the sequence whose tails are ``path``: counts every new substring it ends."""
        counts, children, best = self.counts, self.children, self.best
        counts[ROOT] += 1
        out = [ROOT]
        tails = path[:self.max_depth]  # a tail of max_depth tokens grows no longer
        for i, node in enumerate(tails):
            kids = children[node]
            if kids is None:
                kids = children[node] = {}
                best[node] = token
            child = kids.get(token)
            if child is None:  # a new substring: so is every longer one ending here
                self._grow(tails, i, token, out)
                break
            counts[child] += 1
            b = best[node]
            if b != -1 and counts[child] >= counts[kids[b]]:  # ties go to the latest seen
                best[node] = token
            out.append(child)
        return out

    def _grow(self, tails: list[int], start: int, token: int, out: list[int]) -> None:
        """``extend`` from ``tails[start]`` on, where ``token`` ends substrings never seen: a new child of count 1
        under each tail, its token the tail's best where the tail had no child or its best counts 1 too."""
        counts, children, best = self.counts, self.children, self.best
        for node in tails[start:]:
            kids = children[node]
            if kids is None:
                kids = children[node] = {}
                best[node] = token
            child = kids[token] = self._new()
            counts[child] = 1
            b = best[node]
            if b != -1 and counts[kids[b]] <= 1:  # ties go to the latest seen (-1: looked up when asked)
                best[node] = token
            out.append(child)

    def _new(self) -> int:
        if self._free:
            node = self._free.pop()
            self.best[node] = -1
            return node
        self.counts.append(0)
        self.children.append(None)
        self.best.append(-1)
        return len(self.counts) - 1

    def extend_all(self, path: list[int], tokens: list[int]) -> list[int]:
        """``extend`` by each of ``tokens`` in turn: the path after the last."""
        for token in tokens:
            path = self.extend(path, token)
        return path

    def insert(self, tokens: list[int]) -> None:
        """Adds the sequence ``tokens``."""
        self.extend_all([ROOT], tokens)

    def remove(self, tokens: list[int]) -> None:
        """Takes out a sequence inserted earlier (the same tokens): its counts, and the nodes left at 0."""
        counts, children, best = self.counts, self.children, self.best
        counts[ROOT] -= len(tokens)
        for start in range(len(tokens)):
            node = ROOT
            for token in tokens[start:start + self.max_depth]:
                kids = children[node]
                child = kids[token]
                counts[child] -= 1
                if best[node] == token:  # (another child may count more now)
                    best[node] = -1
                if counts[child] == 0:  # (and so will every node below it on this suffix)
                    del kids[token]
                    if not kids:
                        children[node] = None
                    self._free.append(child)
                node = child

    def advance(self, path: list[int], token: int) -> list[int]:
        """The tails of a sequence (not inserted here) after ``token``, given its tails ``path`` before it."""
        out = [ROOT]
        for node in path:
            kids = self.children[node]
            child = kids.get(token) if kids else None
            if child is None:
                break  # a longer tail cannot occur where a shorter one does not
            out.append(child)
        return out

    def advance_all(self, path: list[int], tokens: list[int]) -> list[int]:
        """``advance`` by each of ``tokens`` in turn: the tails after the last."""
        for token in tokens:
            path = self.advance(path, token)
        return path

    def match(self, tokens: list[int]) -> list[int]:
        """The path of ``tokens``' tails: its last node is the longest tail found, of length ``len(path) - 1``."""
        return self.advance_all([ROOT], tokens[-self.max_depth:])

    def count(self, tokens: list[int]) -> int:
        """How many times ``tokens`` (at most ``max_depth`` of them) occurred; the root's count for []."""
        node = ROOT
        for token in tokens:
            kids = self.children[node]
            node = kids.get(token) if kids else None
            if node is None:
                return 0
        return self.counts[node]

    def chain(self, node: int, budget: int, min_prob: float = 0.0,
              base: int | None = None) -> tuple[list[int], list[float]]:
        """The most frequent continuation of ``node``, a token at a time (among equally frequent children, the
        one that reached that count last; the first seen where a removal had it looked up anew).

        Args:
            node: where the continuation starts (a matched tail).
            budget: most tokens.
            min_prob: the chain ends before a token whose path probability would fall below this.
            base: the occurrences of ``node`` to divide by (default its count; fewer when some, such as the
                sequence being drafted for, have no continuation to offer).

        Returns:
            (tokens, each token's path probability: the product of count ratios from ``node`` down to it).
        """
        counts, children, best = self.counts, self.children, self.best
        tokens: list[int] = []
        probs: list[float] = []
        prob, total = 1.0, counts[node] if base is None else base
        while len(tokens) < budget and children[node]:
            kids = children[node]
            token = best[node]
            if token == -1:
                token = best[node] = max(kids, key=lambda t: counts[kids[t]])
            child = kids[token]
            prob *= counts[child] / total
            if prob < min_prob:
                break
            tokens.append(token)
            probs.append(prob)
            node, total = child, counts[child]
        return tokens, probs

    def pick(self, path: list[int], own: int, budget: int, shortest: int, alpha: float, min_prob: float, tree: bool,
             floor: float) -> tuple[list[int], list[int], list[float], int, int, float] | None:
        """The best-scoring continuation of ``path``'s tails of at least ``shortest`` tokens whose score is above
        ``floor``; None if none is. A tail of d tokens that occurred ``count`` times before (``own`` of them the
        sequence's own, with nothing after them yet) offers its ``chain`` (or ``tree``) of at most
        ``min(budget, ceil(alpha * d), max_depth - d)`` tokens; its score is the sum of their path probabilities
        (the tokens expected accepted, were the counts the odds). Longer tails go first and win ties.

        Returns:
            (tokens, parents (empty for a chain), path probabilities, the tail's length, its count, the score).
        """
        out = None
        for d in range(self.deepest(path, own), shortest - 1, -1):
            count = self.counts[path[d]] - own
            room = min(budget, math.ceil(alpha * d), self.max_depth - d)
            if count < 1 or room < 1 or room <= floor:
                continue  # (a token's probability is at most 1: this tail cannot score more)
            if tree:
                tokens, parents, probs = self.tree(path[d], room, min_prob, count)
            else:
                (tokens, probs), parents = self.chain(path[d], room, min_prob, count), []
            score = 0.0
            for p in probs:  # (left to right, as the compiled trie adds them)
                score += p
            if score > floor:
                floor, out = score, (tokens, parents, probs, d, count, score)
        return out

    def tree(self, node: int, budget: int, min_prob: float = 0.0,
             base: int | None = None) -> tuple[list[int], list[int], list[float]]:
        """The ``budget`` most probable continuation nodes of ``node``, expanded best first (see ``chain``).

        Returns:
            (tokens, parents, path probabilities), numbered parents first (``tree.py``: -1 is ``node``).
        """
        counts, children = self.counts, self.children
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        heap: list[tuple[float, int, int, int]] = []  # (-prob, child, its token, its parent's index)

        def push(parent: int, prob: float, total: int, index: int) -> None:
            for token, child in (children[parent] or {}).items():
                p = prob * counts[child] / total
                if p >= min_prob:
                    heapq.heappush(heap, (-p, child, token, index))

        push(node, 1.0, counts[node] if base is None else base, -1)
        while heap and len(tokens) < budget:
            p, child, token, parent = heapq.heappop(heap)
            tokens.append(token)
            parents.append(parent)
            probs.append(-p)
            push(child, -p, counts[child], len(tokens) - 1)
        return tokens, parents, probs


NATIVE_SOURCE = Path(__file__).with_name("suffix_trie.cpp")


_native: list[ModuleType | None] = []  # the compiled module (None: unavailable), once the first call looked


def native_trie(log: Callable[[str], None] | None = None) -> ModuleType | None:
    """The compiled trie's module (built at the process's first call: about 10 s once per source version, then
    loaded from torch's extension cache), or None where it cannot be built (no compiler or ninja; the reason is
    logged). ``log``: told before the first call looks."""
    if not _native:
        digest = hashlib.sha256(NATIVE_SOURCE.read_bytes()).hexdigest()[:10]
        if log is not None:
            log("loading the compiled suffix trie (its first use compiles it: about 10 s)")
        module, reason = compile_extension(f"specdecode_suffix_trie_{digest}", NATIVE_SOURCE, "the suffix trie")
        if reason is not None and log is not None:
            log(f"suffix tries stay in Python (slower): {reason}")
        _native.append(module)
    return _native[0]


def new_trie(max_depth: int = 32) -> SuffixTrie:
    """An empty trie: the compiled one where it builds, else the Python class. They answer alike; only their
    ``nbytes`` differ (a node's own estimate each), so a cache bounded in bytes keeps ~5x more nodes compiled."""
    module = native_trie()
    return module.SuffixTrie(max_depth) if module is not None else SuffixTrie(max_depth)
