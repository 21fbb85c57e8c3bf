"""Which replica has seen which prompts: the memory behind prefix-aware routing.

Each replica keeps the texts of its most recent requests (a bounded list, oldest dropped first); a new
request's best replica is the one with the longest common prefix with any of them. Texts are compared
as characters, not tokens: the router has no tokenizer, and a shared character prefix is a shared token
prefix up to the last token or so.

It does not measure load nor pick between replicas of equal match (``ray_router.py``), and it knows
nothing of the replicas' caches: a replica may have evicted what the index still remembers.
"""

from __future__ import annotations

import os
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
        """Remembers that ``replica`` served a request starting with ``text``."""
        if text:
            self._texts.setdefault(replica, deque(maxlen=self.per_replica)).append(text[:self.max_chars])

    def forget(self, replica: Hashable) -> None:
        """Drops a replica (it died or was removed)."""
        self._texts.pop(replica, None)

    def best(self, text: str, replicas: Iterable[Hashable]) -> tuple[Hashable | None, int]:
        """The replica among ``replicas`` whose remembered texts share the longest prefix with ``text``,
        and that prefix's length in characters; ``(None, 0)`` where none shares a character."""
        text = text[:self.max_chars]
        winner, longest = None, 0
        for replica in replicas:
            for seen in self._texts.get(replica, ()):
                n = len(os.path.commonprefix((text, seen)))
                if n > longest:
                    winner, longest = replica, n
        return winner, longest
