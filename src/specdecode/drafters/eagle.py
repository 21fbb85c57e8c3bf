"""Drafting with a trained EAGLE-style head (``heads/eagle.py``) over the target's own features.

The engine hands the drafter the target's features of every verified position (``observe``: the prompt's
from prefill, the accepted rows' after each verification). Before drafting, the head catches up on the
rows whose features arrived since the last step: row j pairs feature f_j with token x_{j+1}, so after a
sequence of n tokens rows 0..n-2 are real. Its last output predicts the feature of the newest token and,
through the draft vocabulary's output head, the first draft token; each further draft token feeds the
head its own previous prediction. Drafted rows are trimmed from the head's cache at the end of
``propose``; real rows are committed, so they roll back and compress like any cache's verified rows.

On a prefix-cache hit the target computes no features for the reused prefix, so the head's cache starts
at the first recomputed position (RoPE depends only on relative positions; the head just sees a shorter
context). This drafter never touches the target's cache.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdecode.drafters.base import MODEL_SIGNALS, Draft, OwnCache, StopRule, chain_draft
from specdecode.drafters.tree_search import grow_tree
from specdecode.heads.eagle import EagleHead
from specdecode.heads.vocab import VocabHead
from specdecode.kv.cache import Cache, CacheConfig
from specdecode.kv.memory import KVMemory
from specdecode.models.transformer import Transformer
from specdecode.sampling import SamplingParams


class EagleDrafter(OwnCache):
    """Drafts with ``head`` over ``target``'s features and a draft vocabulary.

    Args:
        target: the target transformer (its embedding table and output rows are used, frozen).
        head: the trained head, already in the target's dtype and on its device (``heads.prepare_head``).
        vocab: the draft vocabulary's output head.
        cache: the head cache's settings (kv dtype, window, sinks); its size follows the target's cache.
        tree_width: children per expanded node of a dynamic draft tree (``tree_search.py``: EAGLE-2's);
            0 drafts chains.
    """

    def __init__(self, target: Transformer, head: EagleHead, vocab: VocabHead,
                 cache: CacheConfig = CacheConfig(), tree_width: int = 0) -> None:
        if tree_width < 0:
            raise ValueError(f"tree_width must be >= 0 (0 = chains), got {tree_width}")
        self.target, self.head, self.vocab = target, head, vocab
        self.tree_width = tree_width
        self.name = "eagle-tree" if tree_width else "eagle"
        self.signal_names = () if tree_width else MODEL_SIGNALS  # a tree has no per-token stop
        # the normed final state (EAGLE-1), or the layers an EAGLE-3 head fuses
        self.feature_layers = head.head_config.fuse_layers or (target.config.num_layers,)
        self.cache_config = cache
        self._base = 0  # sequence position of the head cache's row 0
        self._pending: list[torch.Tensor] = []  # features [T, F*h] observed but not yet run through the head

    @property
    def weight_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.head.parameters(), *self.head.buffers()]) + \
            self.vocab.nbytes

    def reset(self, target_cache: Cache, prompt: Sequence[int] = (), memory: KVMemory | None = None,
              slot: int = 0) -> None:
        self._claim_cache(self.head, target_cache, memory)
        self._base, self._pending = 0, []

    def observe(self, position: int, features: torch.Tensor) -> None:
        """Features ``[T, F*h]`` of the target's verified positions position..position+T-1."""
        expected = self._base + self.cache.lengths[0] + sum(len(f) for f in self._pending)
        if self.cache.lengths[0] == 0 and not self._pending:
            self._base = expected = position  # the first features (after a prefix hit: not position 0)
        if position != expected:
            raise RuntimeError(f"eagle drafter: features for position {position} arrived, expected {expected}")
        self._pending.append(features)

    def propose(self, seq: list[int], k: int, sampling: SamplingParams, generator: torch.Generator,
                stop: StopRule | None = None) -> Draft:
        state = self._catch_up(seq)  # [1, 1, h]: the predicted feature of the newest token
        if state is None:
            return Draft([])

        def advance(token: int) -> torch.Tensor:  # the draft vocabulary's logits after ``token``
            nonlocal state
            ids = torch.tensor([[token]], device=self.target.device)
            state = self.head.step(self.target.embed(ids), state, self.cache)
            return self.vocab(state[0, -1])

        first = self.vocab(state[0, -1])  # [Vd]
        if self.tree_width:
            draft = grow_tree(self.vocab.full(first), self._tree_level(state[0, -1]), k, self.tree_width, sampling,
                              generator)
        else:
            draft = chain_draft(first, advance, k, sampling, generator, stop, self.vocab)
        self.cache.trim(0, len(seq) - 1 - self._base)  # drop the drafted rows; the real ones stay
        return draft

    def _tree_level(self, root: torch.Tensor):
        """``tree_search.RunLevel`` over the head: a node's input feature is its parent's output (``root``,
        ``[h]``, for children of the root)."""
        outputs: list[torch.Tensor] = []  # [h] per tree row

        def run(tokens: list[int], parents: list[int]) -> torch.Tensor:
            new = range(len(parents) - len(tokens), len(parents))
            features = torch.stack([root if parents[r] < 0 else outputs[parents[r]] for r in new])[None]  # [1, T, h]
            ids = torch.tensor([tokens], device=self.target.device)
            out = self.head.step(self.target.embed(ids), features, self.cache, parents)[0]  # [T, h]
            outputs.extend(out)
            return self.vocab.full(self.vocab(out))  # [T, V]
        return run

    def _catch_up(self, seq: list[int]) -> torch.Tensor | None:
        """Runs the head over the rows whose features arrived; returns its last output ``[1, 1, h]``."""
        if not self._pending:
            return None
        features = torch.cat(self._pending)[None]  # [1, T, F*h]
        first = self._base + self.cache.lengths[0]  # position of the first pending feature
        ids = torch.tensor([seq[first + 1:first + 1 + features.shape[1]]], device=self.target.device)
        if ids.shape[1] != features.shape[1]:
            raise RuntimeError(f"eagle drafter: {features.shape[1]} features but {ids.shape[1]} tokens after them")
        out = self.head.step(self.target.embed(ids), self.head.lift(features.to(self.head.dtype)), self.cache)
        self.cache.commit(0, self.cache.lengths[0])
        self._pending = []
        return out[:, -1:]

