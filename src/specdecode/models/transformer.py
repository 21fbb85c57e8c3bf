"""A Llama/Qwen2/Qwen3/Mistral/Gemma 3-family decoder that runs over a KV cache
(:class:`~specdecode.kv.cache.Cache`): the model's maths, apart from how it runs.

One forward takes any number of new tokens per sequence (prefill, one decode step, or a draft to verify),
writes their keys/values into the cache by index, can run a subset of its layers (self-speculation), and
returns a :class:`~specdecode.models.rows.ForwardOutput` (logits of the rows asked for, features of the
layers asked for). ``forward`` takes a batch ``[B, T]``; ``forward_rows`` takes ragged rows of several
sequences (a batch engine's step) and computes every row as it would be alone.

How the layers run is its backend's (``backends/``): our compiled CPU kernels (each layer one fused C++
call), oneDNN, or torch's ``F.linear`` (any device: the GPU path). Layers are in ``block.py``, attention in
``attention.py``, RoPE in ``rope.py``.

It does not build or pack itself (``build.py`` builds it from a checkpoint, ``build.from_hf_tensors`` and
``build.packed_from``; ``packing.pack`` moves it onto a backend), load files (``loader.py``), sample, or decide
what to keep in the cache: callers trim the cache after a forward when draft tokens are rejected.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.kv.cache import Cache, CacheConfig
from specdecode.kv.factory import make_cache
from specdecode.models import packing
from specdecode.models.attention import batch_mask
from specdecode.models.backends import TORCH, Backend, LayerRunner
from specdecode.models.block import Block
from specdecode.models.config import ModelConfig
from specdecode.models.linear import Int8Linear, NativeLinear, PackedLinear, QuantLinear
from specdecode.models.rope import Rope
from specdecode.models.rows import ForwardOutput, LogitRows, plan_rows


class Transformer(nn.Module):
    """Decoder-only transformer with fused projections; built by ``build.from_hf_tensors`` or
    ``build.packed_from`` (its own parameters are left unfilled).

    Args:
        config: the architecture.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # given an (unfilled) table: nn.Embedding's own random init costs seconds of imports on the meta device
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size,
                                  _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = Rope(config)
        # Set by packing.pack(); a tied head then gets its own copy.
        self.head_layer: NativeLinear | QuantLinear | PackedLinear | Int8Linear | None = None
        self.backend: Backend = TORCH  # where the projections and layers run (packing.adopt)
        self.runner: LayerRunner = TORCH.prepare(self.layers, self.rope, self)
        self.packed_as = "bf16"  # the weights packing.pack was asked for

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, config: CacheConfig) -> Cache:
        """A KV cache of the kind ``config`` asks for, shaped for this model, in its dtype and on its device."""
        c = self.config
        return make_cache(c.num_layers, c.num_kv_heads, c.head_dim, config, dtype=self.dtype, device=self.device)

    def synchronize(self) -> None:
        """Waits for the work queued on the model's device (a GPU's), so that a timer read next sees it."""
        self.backend.synchronize(self.device)

    def forward(self, tokens: torch.Tensor, cache: Cache, slots: Sequence[int] = (0,), *,
                layers: Sequence[int] | None = None, logits: LogitRows = LogitRows.ALL,
                features: Sequence[int] = (), invariant_rows: bool = False) -> ForwardOutput:
        """Runs a batch of new tokens through the model, appending their keys/values to the cache.

        Args:
            tokens: ``[B, T]`` new token ids, row b continuing the sequence in ``slots[b]``.
            cache: the KV cache; each slot's length advances by T.
            slots: cache slot of each row.
            layers: indices of the layers to run (self-speculation); None runs all of them.
            logits: ``ALL`` positions (logits ``[B, T, V]``), each row's ``LAST`` (``[B, 1, V]``) or ``NONE``
                (a prefill).
            features: layers whose outputs to return for every new token (drafters built on the target's
                features, e.g. ``drafters/eagle.py``): i < num_layers is layer i's output (the residual
                stream), ``num_layers`` the final normed state the output head reads.
            invariant_rows: compute each row so that it is bitwise independent of how many new tokens
                share the call (:meth:`forward_rows`); the batched attention's summation order is not. On a
                row-invariant backend this makes greedy verification reproduce decoding exactly.

        Returns:
            Float32 logits (None for ``NONE``) and, with ``features``, ``[B, T, len(features) * hidden]``: the
            asked layers side by side in the order given (else None).
        """
        b, t = tokens.shape
        positions = logits.of_positions()
        if invariant_rows or self.runner.fused:  # fused layers have only the row-invariant form
            out = self.forward_rows(tokens.reshape(-1), cache, slots, [t] * b, layers=layers, logits=logits,
                                    features=features)
            return ForwardOutput(None if out.logits is None else out.logits.view(b, 1 if logits.last else t, -1),
                                 None if out.features is None else out.features.view(b, t, -1))
        starts = [cache.lengths[s] for s in slots]
        cos, sin = self._batch_angles(starts, t)  # [K, B, T, 1, D]
        seen = [cache.visible(s) for s in slots]
        masks = {w: batch_mask(seen, t, w, self.device) for w in {block.window for block in self.layers}}
        run = self._check_run(layers, features)
        kept: dict[int, torch.Tensor] = {}
        x = self.embed_rows(tokens)  # [B, T, hidden]
        for i in run:
            block, kind = self.layers[i], self.rope.kind[i]
            x = block(x, i, cache, slots, starts, cos[kind], sin[kind], masks[block.window])
            if i in features:
                kept[i] = x
        cache.advance(slots, t)
        return self._outputs(x, (slice(None), positions) if logits.wanted else None, features, kept)

    def forward_rows(self, tokens: torch.Tensor, cache: Cache, slots: Sequence[int], counts: Sequence[int], *,
                     layers: Sequence[int] | None = None, logits: LogitRows = LogitRows.ALL,
                     features: Sequence[int] = (),
                     parents: Sequence[Sequence[int] | None] | None = None) -> ForwardOutput:
        """Row-invariant forward over ragged rows of several sequences (a batch's verification step).

        Every row is computed as it would be alone (projections row by row on a row-invariant backend,
        attention of each sequence over its own cache), so a sequence's logits are bitwise the same whatever
        else shares the forward.

        Args:
            tokens: ``[N]`` token ids: ``counts[0]`` rows continuing the sequence in ``slots[0]``, then
                ``counts[1]`` rows of ``slots[1]``, ...
            cache: the KV cache; slot ``slots[i]`` advances by ``counts[i]``.
            slots: distinct cache slots.
            counts: rows per slot (>= 1 each, summing to N).
            layers, features: as for :meth:`forward`.
            logits: ``ALL`` rows (logits ``[N, V]``), each sequence's ``LAST`` row (``[len(slots), V]``),
                ``NONE``, or ``LogitRows.at(index)``: the rows ``index`` (``[len(index), V]``; prompt rows in a
                batch need none).
            parents: per sequence, None for consecutive rows, or its rows' parents (a token tree, see
                ``tree.py``: ``parents[j] < j``, -1 = follows the context before the tree): row j then sits
                at that context's length plus its depth and sees the context, its ancestors and itself. The
                list may start with rows earlier forwards wrote (the slot's last tokens; a drafter grows a
                tree a level at a time); its last ``counts[i]`` rows are this forward's. The slot still
                advances by all its rows; ``Cache.compact`` keeps an accepted path afterwards.

        Returns:
            Float32 logits (None for ``NONE``) and, with ``features``, ``[N, len(features) * hidden]`` (else None).
        """
        device = self.device
        if self.config.mixed_windows and parents is not None and any(p is not None for p in parents):
            # a tree's key index is one per forward; these layers would each need their own
            raise ValueError("token trees are not supported on a model whose layers have different attention "
                             "windows (Gemma 3); draft chains instead")
        plan = plan_rows(cache, slots, counts, tokens.shape[0], parents, self.config.sliding_window, device)
        run = self._check_run(layers, features)
        x, kept = self.runner.run(self.embed_rows(tokens), cache, plan, run, features)  # x [N, hidden]
        for slot, n in zip(slots, counts):
            cache.advance((slot,), n)
        return self._outputs(x, (logits.of_rows(counts, device),) if logits.wanted else None, features, kept)

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``tokens`` (any shape), scaled where the model scales them (Gemma), in the
        model dtype as transformers computes them."""
        x = self.embed(tokens)
        if self.config.embed_scale != 1.0:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    def _batch_angles(self, starts: list[int], t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE ``cos``, ``sin`` ``[K, B, T, 1, D]`` (K kinds of layer, ``Rope.kind``) of T new tokens after each
        row's ``starts``."""
        cos_table, sin_table = self.rope.tables(max(starts) + t, self.dtype)  # [K, P, D]
        if len(starts) == 1:
            rows = slice(starts[0], starts[0] + t)
            return cos_table[:, rows][:, None, :, None], sin_table[:, rows][:, None, :, None]
        pos = torch.tensor(starts, device=self.device)[:, None] + torch.arange(t, device=self.device)  # [B, T]
        return cos_table[:, pos][:, :, :, None], sin_table[:, pos][:, :, :, None]

    def _check_run(self, layers: Sequence[int] | None, features: Sequence[int]) -> Sequence[int]:
        """The layers a forward runs; ``features`` checked against them before anything is written to the cache."""
        n = self.config.num_layers
        run = range(n) if layers is None else layers
        bad = [i for i in features if not 0 <= i <= n]
        if bad:
            raise ValueError(f"features {bad} are out of range 0..{n} (layer outputs, then {n} = the normed state)")
        missing = [i for i in features if i < n and i not in run]
        if missing:
            raise ValueError(f"features {missing} name layers this forward skips")
        return run

    def _outputs(self, x: torch.Tensor, pick: tuple | None, features: Sequence[int],
                 kept: dict[int, torch.Tensor]) -> ForwardOutput:
        """Logits of the rows ``x[pick]`` (none for None) and the kept layers' outputs side by side.

        Args:
            x: the residual stream after the last layer, ``[N, hidden]`` or ``[B, T, hidden]`` (the runner's precision).
            pick: an index into ``x``'s leading dimensions, or None.
            features: the layers asked for (``num_layers``: the normed state).
            kept: their outputs, in the model dtype.
        """
        normed = self.config.num_layers in features
        if normed:
            x = self.runner.norm(x)
            kept[self.config.num_layers] = x.to(self.dtype)
        out = None
        if pick is not None:
            rows = x[pick]
            out = self.runner.logits(rows if normed else self.runner.norm(rows))
        return ForwardOutput(out, torch.cat([kept[i] for i in features], dim=-1) if features else None)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The output head over normed states ``[..., hidden]``, in the model dtype."""
        if self.head_layer is not None:
            return self.head_layer(x)
        return F.linear(x, self.embed.weight if self.lm_head is None else self.lm_head.weight)

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The output head's weight rows ``[len(ids), hidden]`` for token ``ids``, in the model dtype (a
        draft head's reduced vocabulary scores with these).

        Raises:
            ValueError: the head runs on oneDNN's opaque packed layout (``PackedLinear.weight_rows``) and the
                model has no tied copy.
        """
        if self.config.tie_word_embeddings:
            return self.embed.weight[ids]
        if self.head_layer is None:
            return self.lm_head.weight[ids]
        return self.head_layer.weight_rows(ids).to(self.dtype)  # each packed layer type reads its own rows

    @property
    def weight_format(self) -> str:
        """The projections' formats (``packing.weight_format``), e.g. "bf16" or "q4_1+q8_0, head q8_0"."""
        return packing.weight_format(self)

    @property
    def weight_nbytes(self) -> int:
        """Bytes held by the weights, packed and quantized copies included."""
        held = sum(t.numel() * t.element_size() for t in [*self.parameters(), *self.buffers()])
        return held + sum(m.nbytes for m in self.modules() if isinstance(m, PackedLinear))
