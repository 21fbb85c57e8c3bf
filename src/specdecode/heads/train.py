"""Training a draft head on cached target features (``data.py``), on the CPU, in float32.

EAGLE: row j takes (feature f_j, token x_{j+1}) and predicts f_{j+1}; the loss is a smooth-L1 regression
to the target's feature plus 0.1 x cross-entropy of the draft-vocabulary logits against the target's
greedy guess there (EAGLE-1), or, with ``soft_labels``, against the target's whole distribution over the
draft vocabulary, which its stored feature f_{j+1} gives through the output rows (EAGLE-3's loss; more
than one bit of what the target thinks per position). Input features get uniform noise, and the head
is also trained ``unroll`` steps deep on its own predictions, attending as it will when drafting
(``EagleHead.forward``), so it learns to continue from its own slightly-off features. Medusa: head i's
logits from f_j against the target's guess i + 1 positions later. Both use the target's frozen embedding
and output rows.

Batches are whole sequences (padded, never cut or mixed), shuffled per epoch from the seed; the noise is
drawn from a generator seeded per epoch. A checkpoint is written after every epoch (atomically), and a
resumed run gives the same weights as an uninterrupted one. After each epoch the held-out accepted length
is measured by drafting as the engine does, greedily, k tokens at a time. This module does not build
data or parse command lines.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.heads.data import DISTILLED, Features
from specdecode.heads.eagle import EagleConfig, EagleHead
from specdecode.heads.file import atomic_write
from specdecode.heads.medusa import MedusaConfig, MedusaHeads
from specdecode.heads.vocab import draft_ids, frequency_ranking
from specdecode.kv.cache import CacheConfig
from specdecode.sampling import argmax_ids

Log = Callable[[str], None]
IGNORE = -100


@dataclass(frozen=True)
class TrainConfig:
    """Training settings (all recorded in the head file).

    Args:
        kind: "eagle" or "medusa".
        epochs: passes over the training sequences.
        lr: peak AdamW learning rate (linear warm-up over ``warmup`` steps, then cosine to 10%).
        batch_tokens: padded tokens per batch.
        seed: shuffling, noise, initialisation and the held-out split.
        draft_vocab: tokens the head may propose (the most frequent in the data; 0 = the whole vocabulary).
        medusa_heads: Medusa's number of heads.
        noise: half-width of the uniform noise added to EAGLE's input features.
        unroll: EAGLE draft steps trained at once (1 = EAGLE-1; more = on its own predictions, weighted 0.8^s).
        ce_weight: weight of EAGLE's cross-entropy next to the feature regression (EAGLE-1: 0.1).
        regress: weight of EAGLE's feature regression (EAGLE-1: 1; EAGLE-3 has none).
        soft_labels: EAGLE's cross-entropy against the target's distribution instead of its greedy guess.
        fuse_layers: the target's layers an EAGLE head fuses (``EagleConfig``; empty: its normed final state).
        held_out: share of the prompts whose answers are kept for measuring accepted length.
        eval_k: draft length of that measurement.
        eval_sequences: held-out sequences it drafts over (every ``eval_stride``-th position).
        eval_stride: see ``eval_sequences``.
        warmup: warm-up steps.
    """

    kind: str = "eagle"
    epochs: int = 4
    lr: float = 1e-3
    batch_tokens: int = 2048
    seed: int = 0
    draft_vocab: int = 16384
    medusa_heads: int = 4
    noise: float = 0.1
    unroll: int = 2
    ce_weight: float = 0.1
    regress: float = 1.0
    soft_labels: bool = False
    fuse_layers: tuple[int, ...] = ()
    held_out: float = 0.05
    eval_k: int = 5
    eval_sequences: int = 20
    eval_stride: int = 3
    warmup: int = 50


def split(data: Features, share: float, seed: int) -> tuple[list[int], list[int]]:
    """Train and held-out sequence indices. Held-out ones are self-distilled, chosen by prompt from the
    seed: every answer to a held-out prompt (greedy and sampled) is held out, so that no sibling answer
    sharing its beginning is trained on."""
    g = torch.Generator().manual_seed(seed)
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for s in range(len(data)):
        if int(data.kinds[s]) == DISTILLED:
            tokens, _, _ = data.sequence(s)
            by_prompt.setdefault(tuple(tokens[:int(data.answer_starts[s])].tolist()), []).append(s)
    groups = list(by_prompt.values())
    order = torch.randperm(len(groups), generator=g).tolist()
    held = sorted(s for i in order[:max(1, round(share * len(groups)))] for s in groups[i])
    held_set = set(held)
    return [s for s in range(len(data)) if s not in held_set], held


def batches(data: Features, seqs: list[int], batch_tokens: int, seed: int) -> list[list[int]]:
    """Sequences shuffled from ``seed``, grouped so that each batch's padded size stays within budget."""
    g = torch.Generator().manual_seed(seed)
    order = [seqs[i] for i in torch.randperm(len(seqs), generator=g).tolist()]
    out, cur, longest = [], [], 0
    for s in order:
        length = int(data.offsets[s + 1] - data.offsets[s])
        if cur and max(longest, length) * (len(cur) + 1) > batch_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(s)
        longest = max(longest, length)
    return out + ([cur] if cur else [])


def _padded(data: Features, seqs: list[int], layers: Sequence[int] = ()) -> tuple[torch.Tensor, ...]:
    """tokens ``[B, L]``, labels ``[B, L]`` (IGNORE on padding), float32 normed final features ``[B, L, h]``,
    mask ``[B, L]``, and float32 features of ``layers`` ``[B, L, F*h]`` (the normed ones again if none)."""
    parts = [data.sequence(s) for s in seqs]
    length = max(len(t) for t, _, _ in parts)
    b, h = len(parts), data.features.shape[1]
    tokens = torch.zeros(b, length, dtype=torch.int64)
    labels = torch.full((b, length), IGNORE, dtype=torch.int64)
    feats = torch.zeros(b, length, h)
    mask = torch.zeros(b, length, dtype=torch.bool)
    for i, (t, y, f) in enumerate(parts):
        tokens[i, :len(t)], labels[i, :len(t)], feats[i, :len(t)], mask[i, :len(t)] = t, y, f.float(), True
    if not layers:
        return tokens, labels, feats, mask, feats
    inputs = torch.zeros(b, length, len(layers) * h)
    for i, s in enumerate(seqs):
        inputs[i, :len(parts[i][0])] = data.fused(s, layers).float()
    return tokens, labels, feats, mask, inputs


class Trainer:
    """Trains one head on one target's cached features.

    Args:
        target: the target ``Transformer`` (embedding table and output rows, frozen).
        data: the cached features.
        config: the settings.
        eos_ids: end-of-sequence ids, kept in the draft vocabulary whatever their count.
    """

    def __init__(self, target, data: Features, config: TrainConfig, eos_ids: Sequence[int] = ()) -> None:
        if config.kind not in ("eagle", "medusa"):
            raise ValueError(f"head kind {config.kind!r} is not one of eagle, medusa")
        self.target, self.data, self.config = target, data, config
        self.train_seqs, self.held_seqs = split(data, config.held_out, config.seed)
        counts = torch.bincount(torch.cat((data.tokens, data.labels)), minlength=target.config.vocab_size)
        self.ranking = frequency_ranking(counts, eos_ids)  # [V], stored in the head file
        self.vocab = draft_ids(self.ranking, config.draft_vocab)  # [Vd]
        index = torch.full((target.config.vocab_size,), IGNORE, dtype=torch.int64)
        index[self.vocab] = torch.arange(self.vocab.numel())
        self.index = index  # token id -> draft vocabulary row, IGNORE outside it
        self.embed = target.embed.weight.detach().float().cpu()  # [V, h]
        self.rows = target.output_rows(self.vocab.to(target.device)).detach().float().cpu()  # [Vd, h]
        torch.manual_seed(config.seed)
        if config.kind == "eagle":
            data.fused(0, config.fuse_layers)  # features of other layers than the head reads are refused here
            self.head: nn.Module = EagleHead(EagleConfig.for_target(target.config, config.fuse_layers))
            self._init_eagle()
        else:
            self.head = MedusaHeads(MedusaConfig(target.config.hidden_size, config.medusa_heads))
        self.head.float().train()
        self.opt = torch.optim.AdamW(self.head.parameters(), lr=config.lr, weight_decay=0.0)
        self.epoch, self.step = 0, 0
        self.history: list[dict] = []
        self.total_steps = sum(len(self.epoch_batches(e)) for e in range(config.epochs))

    def head_config(self) -> dict:
        return self.head.head_config.to_dict()

    def _init_eagle(self) -> None:
        """fc passes the feature through (and a little of the embedding); a fused head's ``fuse`` passes the
        normed final state through where it reads it, so both kinds start where EAGLE-1 starts; the layer
        starts random."""
        h, n = self.target.config.hidden_size, self.target.config.num_layers
        with torch.no_grad():
            self.head.fc.weight[:, h:] = torch.eye(h)
            self.head.fc.weight[:, :h].normal_(0.0, 0.02)
            self.head.fc.bias.zero_()
            layers = self.config.fuse_layers
            if self.head.fuse is not None and n in layers:
                self.head.fuse.weight.normal_(0.0, 0.02)
                at = layers.index(n) * h
                self.head.fuse.weight[:, at:at + h] = torch.eye(h)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """The batches of ``epoch`` (0-based): the training sequences shuffled from the seed and the epoch."""
        c = self.config
        return batches(self.data, self.train_seqs, c.batch_tokens, c.seed * 1000 + epoch)

    def _lr(self) -> float:
        c = self.config
        if self.step < c.warmup:
            return c.lr * (self.step + 1) / c.warmup
        progress = min(1.0, (self.step - c.warmup) / max(1, self.total_steps - c.warmup))
        return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def loss(self, seqs: list[int], generator: torch.Generator | None) -> tuple[torch.Tensor, dict[str, float]]:
        """The batch's loss (and its parts); ``generator`` draws EAGLE's input noise (None: no noise)."""
        c = self.config
        tokens, labels, feats, mask, inputs = _padded(self.data, seqs, c.fuse_layers if c.kind == "eagle" else ())
        drafted = self.index[labels.clamp(min=0)].masked_fill(labels == IGNORE, IGNORE)  # [B, L] draft rows
        if c.kind == "eagle":
            inputs = self.head.normalize(inputs[:, :-1])  # [B, L-1, F*h]
            if generator is not None and c.noise > 0:
                noise = torch.rand(inputs.shape, generator=generator) * 2 - 1
                inputs = inputs + c.noise * noise
            preds = self.head(self.embed[tokens[:, 1:]], inputs, c.unroll)  # per step [B, L-1, h]
            soft = (feats[:, 1:] @ self.rows.T).log_softmax(-1) if c.soft_labels else None  # [B, L-1, Vd]
            total, parts = 0.0, {}
            for step, pred in enumerate(preds):  # row p predicts f_{p+1} at every step
                valid = mask[:, 1:].clone()
                valid[:, :step] = False  # rows whose draft would start before the sequence
                regress = F.smooth_l1_loss(pred[valid], feats[:, 1:][valid])
                logits = pred[valid] @ self.rows.T  # [R, Vd]
                if soft is None:
                    ce = F.cross_entropy(logits, drafted[:, 1:][valid], ignore_index=IGNORE)
                else:
                    ce = F.kl_div(logits.log_softmax(-1), soft[valid], log_target=True, reduction="batchmean")
                total = total + 0.8 ** step * (c.regress * regress + c.ce_weight * ce)
                parts[f"regress{step}"], parts[f"ce{step}"] = regress.item(), ce.item()
            return total, parts
        states = self.head(feats)  # [B, L, K, h]
        total, parts = 0.0, {}
        for i in range(self.config.medusa_heads):
            shift = 1 + i  # head i from f_j guesses the target's guess at j + 1 + i
            if tokens.shape[1] <= shift:
                continue
            logits = states[:, :-shift, i] @ self.rows.T  # [B, L - shift, Vd]
            ce = F.cross_entropy(logits.flatten(0, 1), drafted[:, shift:].flatten(), ignore_index=IGNORE)
            total = total + ce
            parts[f"ce{i}"] = ce.item()
        return total, parts

    def train_epoch(self, progress: Callable[[], None] | None = None) -> float:
        """One pass over the training sequences; returns the mean loss."""
        c = self.config
        generator = torch.Generator().manual_seed(c.seed * 1000 + self.epoch)
        losses = []
        for seqs in self.epoch_batches(self.epoch):
            for group in self.opt.param_groups:
                group["lr"] = self._lr()
            loss, _ = self.loss(seqs, generator)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), 0.5)
            self.opt.step()
            self.step += 1
            losses.append(loss.item())
            if progress is not None:
                progress()
        self.epoch += 1
        return sum(losses) / max(1, len(losses))

    @torch.no_grad()
    def held_out_tau(self) -> float:
        """Mean tokens per target forward (accepted drafts + 1) when drafting ``eval_k`` tokens greedily at
        every ``eval_stride``-th answer position of the held-out sequences, against the target's guesses."""
        c = self.config
        self.head.eval()
        emitted, steps = 0, 0
        for s in self.held_seqs[:c.eval_sequences]:
            tokens, labels, feats = self.data.sequence(s)
            if c.kind == "eagle":
                feats = self.data.fused(s, c.fuse_layers)
            start = int(self.data.answer_starts[s])
            for accepted in self._draft_matches(tokens, labels, feats.float(), start):
                emitted, steps = emitted + accepted + 1, steps + 1
        self.head.train()
        return emitted / max(1, steps)

    def _draft_matches(self, tokens, labels, feats, start: int):
        """Accepted drafts at each evaluated point n (n tokens known; drafts compared with labels[n-1:])."""
        c = self.config
        k, length = c.eval_k, len(tokens)
        points = range(max(start, 2), length - k, c.eval_stride)
        if c.kind == "medusa":
            for n in points:
                states = self.head(feats[n - 2])[:k]  # [k, h]
                guesses = self.vocab[argmax_ids(states @ self.rows.T)]
                yield _leading_matches(guesses, labels[n - 1:n - 1 + k])
            return
        from specdecode.kv.factory import make_cache
        lc = self.head.config
        cache = make_cache(1, lc.num_kv_heads, lc.head_dim, CacheConfig(max_len=-(-length // 256) * 256 + 256),
                           dtype=torch.float32)
        for n in points:
            fed = cache.lengths[0]  # real rows 0..n-2 must be in the cache
            state = self.head.step(self.embed[tokens[fed + 1:n]][None], self.head.lift(feats[fed:n - 1][None]),
                                   cache)[:, -1:]
            guesses = []
            for i in range(k):
                token = int(self.vocab[argmax_ids(state[0, -1] @ self.rows.T)])
                guesses.append(token)
                if i + 1 < k:
                    state = self.head.step(self.embed[[token]][None], state, cache)
            cache.trim(0, n - 1)
            yield _leading_matches(torch.tensor(guesses), labels[n - 1:n - 1 + k])

    def state(self) -> dict:
        return {"head": self.head.state_dict(), "opt": self.opt.state_dict(), "epoch": self.epoch, "step": self.step,
                "history": self.history, "config": asdict(self.config)}

    def load_state(self, state: dict) -> None:
        # settings added since a checkpoint was written count as their defaults
        if {**asdict(TrainConfig()), **state["config"]} != asdict(self.config):
            raise ValueError("the checkpoint was written with other training settings; start afresh or use the same ones")
        self.head.load_state_dict(state["head"])
        self.opt.load_state_dict(state["opt"])
        self.epoch, self.step, self.history = state["epoch"], state["step"], state["history"]


def _leading_matches(guesses: torch.Tensor, truth: torch.Tensor) -> int:
    same = (guesses == truth[:len(guesses)]).long()
    return int(same.cumprod(0).sum())


def save_checkpoint(path: Path, state: dict) -> None:
    """``torch.save`` through ``atomic_write``: an interrupt leaves the previous checkpoint."""
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def train(trainer: Trainer, checkpoint: Path | None, progress_bar, log: Log) -> float:
    """Runs the remaining epochs, checkpointing after each; returns the wall seconds spent."""
    start = time.perf_counter()
    c = trainer.config
    while trainer.epoch < c.epochs:
        bar = progress_bar(len(trainer.epoch_batches(trainer.epoch)), f"steps of epoch {trainer.epoch + 1}/{c.epochs}")
        loss = trainer.train_epoch(bar.update)
        bar.close()
        tau = trainer.held_out_tau()
        trainer.history.append({"epoch": trainer.epoch, "loss": round(loss, 4), "held_out_tau": round(tau, 3)})
        log(f"epoch {trainer.epoch}/{c.epochs}: loss {loss:.4f}, held-out accepted length {tau:.2f} (k={c.eval_k})")
        if checkpoint is not None:
            save_checkpoint(checkpoint, trainer.state())
    return time.perf_counter() - start


__all__ = ["TrainConfig", "Trainer", "batches", "save_checkpoint", "split", "train"]
