"""Drafting with trained Medusa-style heads (``heads/medusa.py``) on the target's last feature.

The target's feature of the last verified position predicts, through head i, the token i + 1 places
after the newest token. All k heads run in one batched matmul; there is no cache and nothing to roll
back. Drafts are verified with the engine's lossless rule (Medusa's own "typical acceptance" is lossy and
not offered).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdecode.drafters.base import MODEL_SIGNALS, Draft, DrafterBase, StopRule, chain_draft
from specdecode.heads.medusa import MedusaHeads
from specdecode.heads.vocab import VocabHead
from specdecode.kv.cache import Cache
from specdecode.kv.memory import KVMemory
from specdecode.models.transformer import Transformer
from specdecode.sampling import SamplingParams


class MedusaDrafter(DrafterBase):
    """Drafts up to ``heads.head_config.heads`` tokens a step.

    Args:
        target: the target transformer.
        heads: the trained heads, in the target's dtype and on its device.
        vocab: the draft vocabulary's output head.
    """

    name = "medusa"
    signal_names = MODEL_SIGNALS

    def __init__(self, target: Transformer, heads: MedusaHeads, vocab: VocabHead) -> None:
        self.target, self.heads, self.vocab = target, heads, vocab
        self.feature_layers = (target.config.num_layers,)
        self._last: torch.Tensor | None = None  # [h] the last verified position's feature
        self._position = -1

    @property
    def weight_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.heads.parameters()) + self.vocab.nbytes

    def reset(self, target_cache: Cache, prompt: Sequence[int] = (), memory: KVMemory | None = None,
              slot: int = 0) -> None:
        self._last, self._position = None, -1

    def observe(self, position: int, features: torch.Tensor) -> None:
        """Features ``[T, h]`` of the target's verified positions position..position+T-1."""
        self._last, self._position = features[-1], position + len(features) - 1

    def propose(self, seq: list[int], k: int, sampling: SamplingParams, generator: torch.Generator,
                stop: StopRule | None = None) -> Draft:
        # Usable only when it is the feature of the token before the newest (n - 2): then head 0 guesses x_n.
        if self._last is None or self._position != len(seq) - 2:
            return Draft([])
        k = min(k, self.heads.head_config.heads)
        states = self.heads(self._last.to(self.heads.weight.dtype))[:k]  # [k, h]
        logits = self.vocab(states)  # [k, Vd]: head i guesses the token i + 1 after the newest
        later = iter(logits[1:])
        return chain_draft(logits[0], lambda token: next(later), k, sampling, generator, stop, self.vocab)

