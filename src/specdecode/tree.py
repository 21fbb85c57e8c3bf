"""Token trees: several draft candidates per position, scored by the target in one forward.

A draft tree of n nodes is each node's token and its parent: ``parents[i]`` is an earlier node (< i) or -1
for a child of the root, the sequence's last token. Numbering parents first lets the target score a tree
as rows ``[root, node 0, ..., node n-1]`` in one forward; a chain d_1..d_k is the tree with parents -1, 0,
..., k-2 (width 1). At the row level (``Transformer.forward_rows``) a sequence's rows carry parents the
same way: row j follows row ``parents[j]``, or the cached context when it is -1; its RoPE position is the
context length plus its depth, and it attends over the context, its ancestors and itself
(:func:`key_index`), in that order, so each row computes what decoding its path one token at a time would.

Not here: drafting trees (``drafters/``), accepting a path (``verify.py``) or moving the accepted rows
into place in a cache (``Cache.compact``).
"""

from __future__ import annotations

from typing import Sequence

import torch


def check_tree(tokens: Sequence[int], parents: Sequence[int]) -> None:
    """Raises ValueError naming what is wrong with a draft tree (lengths, a parent after its child)."""
    if len(tokens) != len(parents):
        raise ValueError(f"a draft tree needs one parent per token: {len(tokens)} tokens, {len(parents)} parents")
    bad = [i for i, p in enumerate(parents) if not -1 <= p < i]
    if bad:
        raise ValueError(f"draft tree node {bad[0]} has parent {parents[bad[0]]}: a parent must be an earlier node "
                         "or -1 (the sequence's last token)")
    seen: set[tuple[int, int]] = set()
    for token, parent in zip(tokens, parents):
        if (parent, token) in seen:
            raise ValueError(f"draft tree node {parent} has token {token} twice among its children")
        seen.add((parent, token))


def chain_parents(n: int) -> list[int]:
    """Parents of a chain of ``n`` nodes (or rows): each follows the one before it."""
    return list(range(-1, n - 1))


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth: 1 for a child of the root (as a chain's i-th token has depth i + 1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to ``node`` (``node`` included; [] for -1, the root)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def children(parents: Sequence[int]) -> dict[int, list[int]]:
    """Node -> its children in node order (-1: the root's)."""
    out: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        out.setdefault(p, []).append(i)
    return out


def key_index(visible: int, parents: Sequence[int], window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of a forward's keys each of one sequence's new rows attends to.

    The keys are as ``Cache.update`` returns them: ``visible`` context entries, then the T new rows. Row j
    sees the context, its ancestor rows root-first and itself, in that order (with a sliding ``window``, the
    last ``window`` of those).

    Args:
        visible: context entries before the new rows (``Cache.visible``).
        parents: row-level parents (``parents[j] < j``, -1 = follows the context).
        window: the model's sliding window, or None.

    Returns:
        ``index [T, M]`` int64 (rows padded with 0 past their count) and ``counts [T]`` int64.
    """
    tails = [[visible + r for r in path_to(parents, j)] for j in range(len(parents))]
    lists = []
    for tail in tails:
        full = len(tail) + visible
        skip = 0 if window is None else max(0, full - window)  # entries before the window
        lists.append((min(skip, visible), tail[max(0, skip - visible):]))
    width = max(visible - lo + len(tail) for lo, tail in lists)
    index = torch.zeros(len(parents), width, dtype=torch.long)
    counts = torch.empty(len(parents), dtype=torch.long)
    for j, (lo, tail) in enumerate(lists):
        n = visible - lo
        index[j, :n] = torch.arange(lo, visible)
        index[j, n:n + len(tail)] = torch.tensor(tail, dtype=torch.long)
        counts[j] = n + len(tail)
    return index, counts


def row_depths(parents: Sequence[int]) -> list[int]:
    """Each row's offset from the context's length: 0 for a row that follows the context."""
    return [d - 1 for d in depths(parents)]


def place_rows(parents: Sequence[int], new: int, start: int, visible: int,
               window: int | None = None) -> tuple[list[int], tuple[torch.Tensor, torch.Tensor] | None]:
    """Positions and key index of the newest ``new`` rows of a tree whose rows so far have row-level
    ``parents``; the earlier rows were written by earlier forwards and are the slot's last tokens (a
    drafter grows its tree one level per forward).

    Args:
        parents: row-level parents of all the tree's rows (-1 = follows the context before the tree).
        new: rows this forward writes (the last ``new`` of ``parents``).
        start: the slot's length before this forward.
        visible: entries ``Cache.update`` returns before the new rows (``Cache.visible``).
        window: the model's sliding window, or None.

    Returns:
        (the new rows' positions, their ``key_index`` or None where they are consecutive: plain causal
        attention then sees the same keys).
    """
    old = len(parents) - new
    if new < 1 or old < 0 or old > min(start, visible):
        raise ValueError(f"a tree of {len(parents)} rows cannot end in {new} new rows after {start} cached tokens")
    base = start - old  # position of the tree's first row
    positions = [base + d for d in row_depths(parents)[old:]]
    if is_chain(parents):
        return positions, None
    index, counts = key_index(visible - old, parents, window)
    return positions, (index[old:], counts[old:])
