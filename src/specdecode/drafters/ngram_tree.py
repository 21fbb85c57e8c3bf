"""Prompt lookup as a token tree: the continuations of several earlier occurrences of the sequence's tail,
merged into a trie, so that the target checks the alternatives they disagree on in the same forward.

Each node counts the occurrences whose continuation passes through it (SuffixDecoding's frequency
score: the share of earlier occurrences that went this way); a node budget keeps the most frequent
nodes, the latest occurrence's first among equals. A parent never counts less than its child and comes
first among equals, so the kept nodes always form a tree. With one occurrence, or when they all agree,
the tree is the chain ``ngram`` proposes. Deterministic (q is one-hot); no index is kept between steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.drafters.base import Draft, DrafterBase, StopRule
from specdecode.drafters.ngram import continuation, find_match, sizes
from specdecode.drafters.registry import DrafterSpec, register
from specdecode.sampling import SamplingParams

# Earlier occurrences of the tail whose continuations make up the tree (the latest ones).
TREE_OCCURRENCES = 16


@dataclass
class NgramTreeDrafter(DrafterBase):
    """Tree drafting from prompt lookup; ``k`` in :meth:`propose` is the node budget.

    Args:
        max_ngram: longest tail to match.
        min_ngram: shortest tail to match.
        occurrences: most earlier occurrences merged.
    """

    max_ngram: int = 3
    min_ngram: int = 1
    occurrences: int = TREE_OCCURRENCES
    name: str = "ngram-tree"
    drafts_past_unverified = True  # stateless: it reads only the sequence it is handed
    signal_names = ()

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"ngram sizes need 1 <= min_ngram <= max_ngram, got {self.min_ngram}..{self.max_ngram}")
        if self.occurrences < 1:
            raise ValueError(f"ngram-tree needs occurrences >= 1, got {self.occurrences}")

    def propose(self, seq: list[int], k: int, sampling: SamplingParams, generator: torch.Generator,
                stop: StopRule | None = None) -> Draft:
        """Up to ``k`` nodes; a tree has no per-token stop signal, so ``stop`` is not consulted."""
        n, starts = find_match(seq, self.min_ngram, self.max_ngram, self.occurrences)
        if not starts or k < 1:
            return Draft([])
        tokens, parents = merge_continuations([continuation(seq, s + n, k) for s in starts], k)
        return Draft(tokens, parents=parents)



def merge_continuations(paths: list[list[int]], budget: int) -> tuple[list[int], list[int]]:
    """The ``budget`` most frequent nodes of the trie of ``paths`` (latest first), numbered parents first.

    Returns:
        (tokens, parents) of the kept nodes; parents are -1 for children of the root.
    """
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    tokens, parents, counts = [], [], []
    for path in paths:
        node = -1
        for token in path:
            child = index.get((node, token))
            if child is None:
                child = index[(node, token)] = len(tokens)
                tokens.append(token)
                parents.append(node)
                counts.append(0)
            counts[child] += 1
            node = child
    # Most frequent first, then in insertion order: a parent sorts before each of its children.
    kept = sorted(range(len(tokens)), key=lambda i: (-counts[i], i))[:budget]
    number = {old: new for new, old in enumerate(kept)}
    return [tokens[i] for i in kept], [number[parents[i]] if parents[i] >= 0 else -1 for i in kept]


register(DrafterSpec("ngram-tree", lambda i: NgramTreeDrafter(**sizes(i)),
                     "n-gram lookup drafting every continuation seen, as a token tree", tree=True, flags=("--ngram",)))
