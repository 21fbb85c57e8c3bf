"""A separate small model drafts autoregressively over its own KV cache.

The draft must share the target's vocabulary (same ids for the same tokens): a mismatched pair is
refused at construction. The draft's cache (its own kind: ``--draft-kv-dtype``, the window settings) is
allocated under the engine's KV budget, prefilled through the draft model's prefix cache, and rolled
back and committed with the target's in ``commit``. This module does not load models (see
``models/loader.py``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdecode.drafters.base import MODEL_SIGNALS, Draft, OwnCache, StopRule, model_draft
from specdecode.drafters.registry import DrafterInputs, DrafterSpec, Needs, register
from specdecode.drafters.tree_search import grow_tree
from specdecode.heads.vocab import RequestVocab, VocabHead, draft_ids, id_ranking
from specdecode.kv.cache import Cache, CacheConfig
from specdecode.kv.memory import KVMemory
from specdecode.models.prefill import prefill
from specdecode.models.rows import LogitRows
from specdecode.models.transformer import Transformer
from specdecode.sampling import SamplingParams


class VocabularyMismatchError(ValueError):
    """Draft and target tokenizers disagree, so draft token ids would mean other tokens to the target."""


def check_same_vocabulary(target_tokens: list[str], draft_tokens: list[str], target_size: int,
                          draft_size: int) -> None:
    """Refuses a draft whose token ids name other tokens than the target's.

    Args:
        target_tokens: the target tokenizer's vocabulary, by id.
        draft_tokens: the draft tokenizer's vocabulary, by id.
        target_size: rows of the target's output head (may exceed the tokenizer, e.g. Qwen's padding).
        draft_size: rows of the draft's output head.
    """
    if target_tokens != draft_tokens:
        first = next((i for i, (a, b) in enumerate(zip(target_tokens, draft_tokens)) if a != b),
                     min(len(target_tokens), len(draft_tokens)))
        raise VocabularyMismatchError(
            f"draft and target vocabularies differ (target has {len(target_tokens)} tokens, draft "
            f"{len(draft_tokens)}; first difference at id {first}); a draft model must use the target's tokenizer")
    if target_size != draft_size:
        raise VocabularyMismatchError(
            f"draft output head has {draft_size} rows but the target's has {target_size}; they must match")


def check_draft_pair(target, draft) -> None:
    """:func:`check_same_vocabulary` for two loaded models (anything with ``.model`` and ``.tokenizer``)."""
    check_same_vocabulary(target.tokenizer.vocab(), draft.tokenizer.vocab(),
                          target.model.config.vocab_size, draft.model.config.vocab_size)


# A draft model's default draft vocabulary: its end-of-sequence ids and first ids (``draft_vocabulary``), which
# score a drafted token with a fifth of Qwen2.5's output head. A request whose prompt has more than
# FULL_VOCAB_SHARE of its tokens outside them (the bench's multilingual prompts: 0.30-0.75 outside Qwen's first
# 32768 ids, every other suite's at most 0.22) drafts over the whole vocabulary instead.
DRAFT_VOCAB = 32768
FULL_VOCAB_SHARE = 0.25


class DraftModelDrafter(OwnCache):
    """Drafting with a separate (smaller) model: a chain, or with ``tree_width`` a dynamic tree
    (``tree_search.py``; ``k`` is then the node budget).

    Args:
        model: the draft transformer.
        target: the target it drafts for; when given, output heads of different sizes are refused here
            (token-level vocabulary checks need the tokenizers: see :func:`check_draft_pair`).
        cache: the draft cache's settings (kv dtype, window, sinks); its size follows the target's cache.
        tree_width: children per expanded node (0: draft chains).
        vocab: a draft vocabulary (``heads/vocab.py``) scoring the drafts with that share of the model's output
            head, widened by each request's own tokens (``RequestVocab``), for the requests whose prompts it
            mostly covers (``FULL_VOCAB_SHARE``); None scores the whole vocabulary.
    """

    def __init__(self, model: Transformer, target: Transformer | None = None,
                 cache: CacheConfig = CacheConfig(), tree_width: int = 0, vocab: VocabHead | None = None) -> None:
        if target is not None and target.config.vocab_size != model.config.vocab_size:
            raise VocabularyMismatchError(
                f"draft output head has {model.config.vocab_size} rows but the target's has "
                f"{target.config.vocab_size}; a draft model must use the target's vocabulary")
        if tree_width < 0:
            raise ValueError(f"tree_width must be >= 0 (0 = chains), got {tree_width}")
        self.model = model
        self.cache_config = cache
        self.tree_width = tree_width
        self.vocab = vocab
        self._request_vocab: RequestVocab | None = None  # ``vocab`` and this request's tokens
        self.name = "draft-tree" if tree_width else "draft"
        self.signal_names = () if tree_width else MODEL_SIGNALS  # a tree has no per-token stop
        self.drafts_past_unverified = True  # it feeds what it has not seen and trims back in commit

    @property
    def weight_nbytes(self) -> int:
        return self.model.weight_nbytes + (self.vocab.nbytes if self.vocab is not None else 0)

    def reset(self, target_cache: Cache, prompt: Sequence[int] = (), memory: KVMemory | None = None,
              slot: int = 0) -> None:
        memory = self._claim_cache(self.model, target_cache, memory)
        # Prefill here, so that drafting time counts drafting only.
        prefill(self.cache, 0, list(prompt[:-1]), self.model, memory.prefix_for(self.model, self.cache.config))
        self._request_vocab = None
        if self.vocab is not None and covers(self.vocab, prompt):
            self._request_vocab = RequestVocab(self.vocab, self.model)
            self._request_vocab.add(prompt)

    def propose(self, seq: list[int], k: int, sampling: SamplingParams, generator: torch.Generator,
                stop: StopRule | None = None) -> Draft:
        # Feed whatever the draft has not seen: the whole prompt first time, then 1-2 tokens a step.
        fed = seq[self.cache.lengths[0]:]
        vocab = self._request_vocab
        if vocab is not None:
            vocab.add(fed)  # the tokens the request gained since the last step
        if not self.tree_width:
            return model_draft(self.model, self.cache, fed, k, sampling, generator, stop=stop, vocab=vocab)
        first = self._logits(fed, None, last=True)[-1]
        held = self.cache.lengths[0]
        draft = grow_tree(first, self._logits, k, self.tree_width, sampling, generator)
        self.cache.trim(0, held)  # the tree's rows; the accepted ones are fed again next step
        return draft

    def _logits(self, tokens: list[int], parents: list[int] | None, last: bool = False) -> torch.Tensor:
        """``[T, V]`` logits of the rows ``tokens`` (a tree level with ``parents``; ``last``: ``[1, V]`` of the
        last row only), -inf outside the draft vocabulary."""
        rows, counts, vocab = torch.tensor(tokens, device=self.model.device), (len(tokens),), self._request_vocab
        if vocab is None:
            return self.model.forward_rows(rows, self.cache, (0,), counts, parents=[parents],
                                           logits=LogitRows.LAST if last else LogitRows.ALL).logits
        state = self.model.forward_rows(rows, self.cache, (0,), counts, parents=[parents], logits=LogitRows.NONE,
                                        features=(self.model.config.num_layers,)).features  # [T, hidden]
        return vocab.full(vocab(state[-1:] if last else state))

    def commit(self, seq: list[int]) -> None:
        # Cached entries past len(seq) - 1 are rejected drafts (or the token still to be fed): drop them.
        # What is left are tokens of seq, which the target has verified.
        self.cache.trim(0, min(self.cache.lengths[0], len(seq) - 1))
        self.cache.commit(0, self.cache.lengths[0])


def covers(vocab: VocabHead, prompt: Sequence[int]) -> bool:
    """Whether at most FULL_VOCAB_SHARE of ``prompt``'s tokens lie outside the draft vocabulary ``vocab``: id order
    is no frequency ranking for every language (the first 65536 of Qwen2.5's ids hold 98% of the English and code
    suites' tokens but half of a Chinese or Japanese text's; each request's own tokens joining the vocabulary
    win back only part of that: BENCHMARKS.md X-9)."""
    if not prompt:
        return True
    inside = int(vocab.held[torch.tensor(list(prompt), dtype=torch.int64, device=vocab.held.device)].sum())
    return len(prompt) - inside <= FULL_VOCAB_SHARE * len(prompt)


def draft_vocabulary(model: Transformer, size: int | None, always: Sequence[int] = ()) -> VocabHead | None:
    """The output head over ``size`` token ids of a draft model (None: DRAFT_VOCAB): ``always`` (the target's
    end-of-sequence ids), then its first ids (``heads.vocab.id_ranking``); None for the whole vocabulary
    (``size`` 0 or at least the vocabulary).

    Raises:
        ValueError: a negative size, or ``always`` outside the vocabulary.
    """
    size = DRAFT_VOCAB if size is None else size
    if size < 0:
        raise ValueError(f"--draft-vocab must be >= 0 (0 = all tokens), got {size}")
    if size == 0 or size >= model.config.vocab_size:
        return None
    return VocabHead(model, draft_ids(id_ranking(model.config.vocab_size, always), size))


def model_drafter(inputs: DrafterInputs, name: str = "draft", tree_width: int = 0) -> DraftModelDrafter:
    """The draft model's drafter of ``inputs`` (its draft vocabulary shared by the slots' drafters).

    Raises:
        ValueError: ``inputs`` hold no draft model.
    """
    if inputs.draft_model is None:
        raise ValueError(f"drafter {name!r} needs a draft model (--draft-model NAME|PATH)")
    shared = inputs.shared  # one draft vocabulary's head for every slot's drafter
    if "draft-vocab" not in shared:
        shared["draft-vocab"] = draft_vocabulary(inputs.draft_model, inputs.draft_vocab, inputs.eos_ids)
    return DraftModelDrafter(inputs.draft_model, inputs.target, inputs.draft_cache, tree_width, shared["draft-vocab"])


MODEL_FLAGS = ("--draft-model", "--draft-quant", "--draft-weights", "--draft-vocab")  # the draft model's flags
register(DrafterSpec("draft", lambda i: model_drafter(i, "draft", 0), "a smaller model with the target's vocabulary",
                     Needs.DRAFT_MODEL, owns_cache=True, flags=MODEL_FLAGS))
register(DrafterSpec("draft-tree", lambda i: model_drafter(i, "draft-tree", i.tree_width),
                     "a draft model searching a token tree",
                     Needs.DRAFT_MODEL, owns_cache=True, tree=True, flags=(*MODEL_FLAGS, "--tree-width")))
