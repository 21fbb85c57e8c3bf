"""A radix tree of verified token prefixes and their full-precision keys/values, shared across requests.

Edges are labelled with token ids; each node holds the per-layer K/V ``[kv_heads, n, head_dim]`` of its
edge's tokens, as the model computed them (after RoPE, in the model's dtype). A request looks up the
longest stored prefix of its prompt (``match``), copies that K/V into its cache slot, prefills only the
rest, and inserts what it prefilled (``insert``). Only verified tokens are ever inserted: the engine
inserts prompt tokens, never drafts, and never generated tokens (their K/V come from decode forwards,
whose rounding differs from a prefill's, so reusing them would not reproduce a cold run bitwise).

Prefixes are reused in whole blocks (the prefill chunk): a prefill computes its chunks at fixed
positions, so a chunk's K/V is bitwise the same whoever computed it, and a hit reproduces a cold cache
exactly. Nodes a request uses carry a reference count until it releases its hit; unreferenced leaves
are evicted least recently used first, whenever the tree would outgrow the room its budget leaves.

This module does not run models or fill caches (see ``prefill.py``) and serves one request at a time:
a hit's K/V must be read before the next insert, which may split the hit's last node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [kv_heads, n, head_dim]


class _Node:
    """One edge of the tree: its tokens and their K/V."""

    def __init__(self, tokens: tuple[int, ...], kv: LayerKV, parent: "_Node | None", tick: int) -> None:
        self.tokens = tokens
        self.kv = kv
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.refs = 0
        self.last_used = tick

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)


@dataclass
class PrefixHit:
    """The reusable part of a prompt: ``length`` tokens (a multiple of the block), and the nodes that
    hold their K/V, referenced until :meth:`PrefixCache.release`."""

    length: int
    nodes: list[_Node] = field(default_factory=list)


class PrefixCache:
    """Token-keyed radix tree with reference counts, LRU eviction and a byte allowance.

    Args:
        block: tokens per reusable block (hits and inserts are whole blocks).
        room: returns the bytes this tree may hold right now (None = no limit); asked on every insert.
    """

    def __init__(self, block: int, room: Callable[[], int | None] = lambda: None) -> None:
        if block < 1:
            raise ValueError(f"PrefixCache.block must be >= 1, got {block}")
        self.block = block
        self.room = room
        self.root = _Node((), [], None, 0)
        self.nbytes = 0
        self.evicted_tokens = 0  # tokens dropped to make room, over the tree's life
        self._tick = 0

    # ------------------------------------------------------------------ reading

    def match(self, tokens: Sequence[int]) -> PrefixHit:
        """The longest stored prefix of ``tokens``, rounded down to whole blocks; its nodes are referenced."""
        path, matched, node = [], 0, self.root
        while matched < len(tokens):
            child = node.children.get(tokens[matched])
            if child is None:
                break
            n = common_prefix(child.tokens, tokens[matched:])
            path.append(child)
            matched += n
            if n < len(child.tokens):
                break
            node = child
        usable = matched // self.block * self.block
        nodes, covered = [], 0
        for node in path:
            if covered >= usable:
                break
            nodes.append(node)
            covered += len(node.tokens)
        self._tick += 1
        for node in nodes:
            node.refs += 1
            node.last_used = self._tick
        return PrefixHit(usable, nodes)

    def kv(self, hit: PrefixHit) -> LayerKV:
        """The hit's K/V per layer, ``[kv_heads, hit.length, head_dim]`` (a copy)."""
        parts, offset = [], 0
        for node in hit.nodes:
            n = min(len(node.tokens), hit.length - offset)
            parts.append([(k[:, :n], v[:, :n]) for k, v in node.kv])
            offset += n
        if not parts:
            return []
        return [(torch.cat([p[i][0] for p in parts], dim=1), torch.cat([p[i][1] for p in parts], dim=1))
                for i in range(len(parts[0]))]

    def release(self, hit: PrefixHit) -> None:
        """Drops the references ``match`` took."""
        for node in hit.nodes:
            if node.refs < 1:
                raise RuntimeError("prefix cache: a hit was released twice")
            node.refs -= 1
        hit.nodes = []

    # ------------------------------------------------------------------ writing

    def insert(self, tokens: Sequence[int], kv: LayerKV, hit: PrefixHit) -> int:
        """Stores ``tokens`` (whole blocks), of which the first ``hit.length`` are the hit's.

        Args:
            tokens: verified tokens from position 0; ``len(tokens)`` a multiple of the block.
            kv: per layer, K/V ``[kv_heads, len(tokens) - hit.length, head_dim]`` of ``tokens[hit.length:]``.
            hit: what ``match`` returned for these tokens (still referenced).

        Returns:
            Tokens newly stored (fewer than asked when the byte allowance does not hold them all, after
            evicting every unreferenced entry it could).
        """
        if len(tokens) % self.block:
            raise ValueError(f"prefix cache stores whole blocks of {self.block} tokens, got {len(tokens)}")
        node, pos, walked = self.root, 0, []
        self._tick += 1
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = common_prefix(child.tokens, tokens[pos:])
            if n < len(child.tokens):
                self._split(child, n)
            child.refs += 1  # protected from eviction while this insert runs
            child.last_used = self._tick
            walked.append(child)
            node, pos = child, pos + n
        try:
            if pos < hit.length:
                raise ValueError(f"prefix cache: the hit's {hit.length} tokens are not a prefix of the inserted tokens")
            end = self._fit(pos, len(tokens), kv, hit.length)
            if end > pos:
                rest = [(k[:, pos - hit.length:end - hit.length].clone(), v[:, pos - hit.length:end - hit.length].clone())
                        for k, v in kv]
                leaf = _Node(tuple(tokens[pos:end]), rest, node, self._tick)
                node.children[leaf.tokens[0]] = leaf
                self.nbytes += leaf.nbytes
            return max(0, end - pos)
        finally:
            for child in walked:
                child.refs -= 1

    def _fit(self, start: int, end: int, kv: LayerKV, offset: int) -> int:
        """Evicts until ``[start, end)`` fits the allowance; returns the end that fits (whole blocks)."""
        per_token = sum(k[:, :1].numel() * k.element_size() + v[:, :1].numel() * v.element_size() for k, v in kv)
        room = self.room()
        if room is None or end <= start:
            return end
        self.evict(self.nbytes + (end - start) * per_token - room)
        fits = (room - self.nbytes) // per_token if per_token else end - start
        return min(end, (start + max(0, fits)) // self.block * self.block)

    def _split(self, node: _Node, n: int) -> None:
        """Cuts ``node``'s edge after ``n`` tokens. ``node`` keeps the first part (so a hit holding it stays
        valid); a new, unreferenced child takes the rest."""
        lower = _Node(node.tokens[n:], [(k[:, n:].clone(), v[:, n:].clone()) for k, v in node.kv], node, node.last_used)
        lower.children = node.children
        for child in lower.children.values():
            child.parent = lower
        before = node.nbytes
        node.tokens, node.kv = node.tokens[:n], [(k[:, :n].clone(), v[:, :n].clone()) for k, v in node.kv]
        node.children = {lower.tokens[0]: lower}
        self.nbytes += node.nbytes + lower.nbytes - before

    # ------------------------------------------------------------------ eviction and accounting

    def evict(self, nbytes: int) -> int:
        """Frees at least ``nbytes`` by dropping unreferenced leaves, least recently used first (fewer when
        only referenced entries are left). Returns the bytes freed."""
        freed = 0
        while freed < nbytes:
            leaves = [n for n in self._nodes() if not n.children and n.refs == 0]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: n.last_used)
            del victim.parent.children[victim.tokens[0]]
            freed += victim.nbytes
            self.nbytes -= victim.nbytes
            self.evicted_tokens += len(victim.tokens)
        return freed

    def _nodes(self) -> Iterator[_Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @property
    def tokens(self) -> int:
        """Tokens stored (edges summed)."""
        return sum(len(n.tokens) for n in self._nodes())

    @property
    def referenced(self) -> int:
        """Sum of all reference counts (0 when no request holds a hit)."""
        return sum(n.refs for n in self._nodes())


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
