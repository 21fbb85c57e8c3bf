"""Which replica has seen which prompts: the memory behind prefix-aware routing.

Each replica keeps the texts of its most recent requests (a bounded list, oldest dropped first); a new
request's best replica is the one with the longest common prefix with any of them. Texts are compared
as characters, not tokens: the router has no tokenizer, and a shared character prefix is a shared token
prefix up to the last token or so.

It does not measure load (the router hands :meth:`PrefixIndex.affine` the queue lengths it knows) nor
pick among the replicas it returns (Ray takes the shortest queue), and it knows nothing of the replicas' caches: a replica may have evicted what the index still
remembers.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, Iterable


class PrefixIndex:
    """The recent request texts of each replica.

    Args:
        per_replica: texts remembered per replica.
        max_chars: characters kept of each text (longer prompts are matched on their start only).
    """

    def __init__(self, per_replica: int = 256, max_chars: int = 4096) -> None:
        if per_replica < 1 or max_chars < 1:
            raise ValueError(f"per_replica and max_chars must be >= 1; got {per_replica} and {max_chars}")
        self.per_replica, self.max_chars = per_replica, max_chars
        self._texts: dict[Hashable, deque[str]] = {}

    def record(self, replica: Hashable, text: str) -> None:
        """Remembers that ``replica`` served a request starting with ``text`` (once: a repeat moves it to
        the newest place)."""
        if not text:
            return
        texts = self._texts.setdefault(replica, deque(maxlen=self.per_replica))
        text = text[:self.max_chars]
        if text in texts:
            texts.remove(text)
        texts.append(text)

    def forget(self, replica: Hashable) -> None:
        """Drops a replica (it died or was removed)."""
        self._texts.pop(replica, None)

    def best(self, text: str, replicas: Iterable[Hashable]) -> tuple[list[Hashable], int]:
        """The replicas among ``replicas`` whose remembered texts share the longest prefix with ``text``
        (all of them where several tie), and that prefix's length in characters; ``([], 0)`` where none
        shares a character."""
        text = text[:self.max_chars]
        winners: list[Hashable] = []
        longest = 0
        for replica in replicas:
            n = max((common_prefix_length(text, seen) for seen in self._texts.get(replica, ())), default=0)
            if n > longest:
                winners, longest = [replica], n
            elif n == longest and n > 0:
                winners.append(replica)
        return winners, longest


    def affine(self, text: str, queues: dict[Hashable, int], min_match_chars: int, imbalance: int) -> list[Hashable]:
        """The replicas ``text`` should go to for its prefix: those of ``queues`` (replica -> queue length)
        sharing the longest prefix with it, at least ``min_match_chars``, whose queue is at most
        ``imbalance`` longer than the shortest; [] where none qualifies (route by load instead)."""
        best, matched = self.best(text, queues)
        if not best or matched < min_match_chars:
            return []
        shortest = min(queues.values())
        return [r for r in best if queues[r] - shortest <= imbalance]


def common_prefix_length(a: str, b: str) -> int:
    """Characters ``a`` and ``b`` share from the start: a binary search over slice comparisons, so that
    the per-character work runs in C (a 4096-character match costs ~12 comparisons)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low
