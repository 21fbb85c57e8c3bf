"""Training data for draft heads, built on this machine with no hub: the target's own answers to the
packaged prompt set (self-distillation), plus teacher-forced text that lies on any machine with Python
(the standard library's own sources), run through the target once to cache its features.

Each sequence stores its tokens, the target's features (its normed final state, bf16; and, for heads that
fuse several layers, those layers' outputs) and the target's greedy next-token guess at every position
(``labels``: what greedy verification compares drafts with).
Answers are appended to ``answers.jsonl`` as they are generated, so an interrupted run resumes where it
stopped; the feature file is written under a temporary name and renamed. This module does not train.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Callable, Sequence

import torch
from safetensors.torch import load_file, save_file

from specdecode.heads.file import atomic_write
from specdecode.kv.cache import CacheConfig
from specdecode.models.rows import LogitRows
from specdecode.prompts import Prompt, load_prompts, render
from specdecode.sampling import argmax_ids

Log = Callable[[str], None]
DISTILLED, TEXT = 0, 1  # kinds of sequence


def packaged_prompts() -> Path:
    """The prompt set written for head training, disjoint from the bench suites: 420 handwritten prompts in 7
    categories, then 884 composed by ``tools/compose_head_prompts.py`` (new topics, tasks, sentences and numbers,
    new instructions over the handwritten passages and conversations)."""
    return Path(str(resources.files("specdecode.heads") / "data" / "prompts.jsonl"))


@dataclass(frozen=True)
class DataConfig:
    """What goes into the training data.

    Args:
        prompts: the prompt file (JSONL as for ``specdecode bench --prompts``); None = the packaged set.
        max_new_tokens: length limit of each self-distilled answer.
        text_chunks: chunks of Python standard-library source, teacher-forced (0 = none).
        chunk_tokens: tokens per text chunk.
        sampled: sampled answers per prompt besides the greedy one (more of the target's own text).
        temperature: their sampling temperature.
        seed: their seeds start here.
        batch: answers decoded side by side.
    """

    prompts: str | None = None
    max_new_tokens: int = 192
    text_chunks: int = 150
    chunk_tokens: int = 256
    sampled: int = 2
    temperature: float = 0.8
    seed: int = 0
    batch: int = 16

    def key(self, fingerprint: str, weights: str = "bf16") -> str:
        """A folder name that changes whenever the data would (model and its weight format, settings, prompt
        file contents)."""
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode())
        if weights != "bf16":  # bf16 folders keep the names they had before other formats existed
            digest.update(weights.encode())
        digest.update(Path(self.prompts or packaged_prompts()).read_bytes())
        return f"{fingerprint}-{digest.hexdigest()[:12]}"


@dataclass
class Features:
    """Cached sequences, flattened.

    Args:
        tokens: ``[N]`` int64 token ids of all sequences, back to back.
        labels: ``[N]`` int64, the target's greedy guess of the token after each position.
        features: ``[N, h]`` bf16, the target's normed final state at each position.
        offsets: ``[S + 1]`` int64, sequence s is ``offsets[s]:offsets[s + 1]``.
        kinds: ``[S]`` int64, DISTILLED or TEXT.
        answer_starts: ``[S]`` int64, where each sequence's answer begins (0 for text).
        layers: ``[N, F*h]`` bf16, the outputs of the target's layers ``layer_ids`` side by side (features as
            ``Transformer.forward`` returns them), or None.
        layer_ids: ``[F]`` int64, which layers ``layers`` holds, or None.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    features: torch.Tensor
    offsets: torch.Tensor
    kinds: torch.Tensor
    answer_starts: torch.Tensor
    layers: torch.Tensor | None = None
    layer_ids: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def sequence(self, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens ``[L]``, labels ``[L]`` and features ``[L, h]`` of sequence ``s``."""
        a, b = int(self.offsets[s]), int(self.offsets[s + 1])
        return self.tokens[a:b], self.labels[a:b], self.features[a:b]

    def fused(self, s: int, layers: Sequence[int]) -> torch.Tensor:
        """The features ``[L, F*h]`` of ``layers`` at sequence ``s``'s positions (what a head reads)."""
        a, b = int(self.offsets[s]), int(self.offsets[s + 1])
        if not layers:
            return self.features[a:b]
        if self.layer_ids is None or self.layer_ids.tolist() != list(layers):
            have = [] if self.layer_ids is None else self.layer_ids.tolist()
            raise ValueError(f"the cached features hold layers {have}, the head reads layers {list(layers)}")
        return self.layers[a:b]


def python_source_chunks(tokenizer, count: int, chunk_tokens: int) -> list[list[int]]:
    """``count`` chunks of ``chunk_tokens`` tokens from the standard library's .py files, the same on any
    machine with the same Python: files in name order, every file's first chunk, then its second ..."""
    if count <= 0:
        return []
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    chunks: list[list[int]] = []
    for round_ in range(64):
        for path in files:
            ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
            piece = ids[round_ * chunk_tokens:(round_ + 1) * chunk_tokens]
            if len(piece) == chunk_tokens:
                chunks.append(piece)
                if len(chunks) == count:
                    return chunks
    return chunks


@torch.inference_mode()
def answer_batch(model, prompts: list[list[int]], max_new_tokens: int, eos: frozenset[int],
                 temperature: float = 0.0, seed: int = 0) -> list[list[int]]:
    """Continuations of several prompts, decoded side by side (one forward per step for all): greedy, or
    sampled at ``temperature`` from a generator seeded with ``seed``.

    Batched attention rounds differently from a lone decode, so a near-tie may rarely go the other way
    than in ``Engine.generate``; training labels come from ``target_features``, never from these tokens.
    """
    generator = torch.Generator(model.device).manual_seed(seed)

    def pick(logits: torch.Tensor) -> list[int]:  # [B, V] -> B tokens
        if temperature == 0.0:
            return argmax_ids(logits).tolist()
        probs = (logits.float() / temperature).softmax(-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()

    longest = max(map(len, prompts)) + max_new_tokens
    cache = model.new_cache(CacheConfig(max_len=-(-longest // 256) * 256, slots=len(prompts)))
    answers: list[list[int]] = []
    for slot, ids in enumerate(prompts):
        logits = model(torch.tensor([ids], device=model.device), cache, slots=(slot,), logits=LogitRows.LAST).logits
        answers.append(pick(logits[:, -1]))
    live = [s for s in range(len(prompts)) if answers[s][-1] not in eos]
    while live:
        live = [s for s in live if len(answers[s]) < max_new_tokens]
        if not live:
            break
        tokens = torch.tensor([[answers[s][-1]] for s in live], device=model.device)  # [B, 1]
        for s, token in zip(live, pick(model(tokens, cache, slots=live, logits=LogitRows.LAST).logits[:, -1])):
            answers[s].append(int(token))
        live = [s for s in live if answers[s][-1] not in eos]
    return answers


def distill_answers(loaded, prompts: list[Prompt], path: Path, config: "DataConfig", progress) -> list[dict]:
    """The target's answers to ``prompts`` (greedy, then ``config.sampled`` sampled ones each), ``config.batch``
    at a time, appended to ``path`` (JSONL) as they come; answers already there (an interrupted run) are
    reused."""
    done: dict[str, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
                done[row["id"]] = row
            except (json.JSONDecodeError, KeyError):
                pass  # a line cut short by an interrupt: that answer is generated again
        with open(path, "w") as f:  # keep only whole lines before appending
            f.writelines(json.dumps(r) + "\n" for r in done.values())
    eos = frozenset(loaded.tokenizer.eos_token_ids)
    keys = [[p.id if k == 0 else f"{p.id}#{k}" for p in prompts] for k in range(1 + config.sampled)]
    with open(path, "a") as f:
        for k, names in enumerate(keys):  # k = 0: greedy; k >= 1: sampled, one seed per batch
            todo = [i for i, key in enumerate(names) if key not in done]
            for _ in range(len(names) - len(todo)):
                progress()
            for a in range(0, len(todo), config.batch):
                group = todo[a:a + config.batch]
                ids = [render(prompts[i], loaded.tokenizer) for i in group]
                answers = answer_batch(loaded.model, ids, config.max_new_tokens, eos,
                                       0.0 if k == 0 else config.temperature, config.seed + 1000 * k + group[0])
                for i, prompt_ids, answer in zip(group, ids, answers):
                    done[names[i]] = {"id": names[i], "category": prompts[i].category, "prompt_ids": prompt_ids,
                                      "answer_ids": answer}
                    f.write(json.dumps(done[names[i]]) + "\n")
                    progress()
                f.flush()
    return [done[key] for names in keys for key in names]


@torch.inference_mode()
def target_features(model, ids: list[int],
                    layers: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One forward of the target over ``ids``: its greedy guesses ``[L]``, normed final states ``[L, h]`` and,
    with ``layers``, those layers' outputs ``[L, F*h]`` (else None)."""
    cache = model.new_cache(CacheConfig(max_len=-(-len(ids) // 256) * 256))
    out = model(torch.tensor([ids], device=model.device), cache, features=(model.config.num_layers, *layers))
    logits, hidden = out.logits, out.features[0].to("cpu", torch.bfloat16)
    h = model.config.hidden_size
    return argmax_ids(logits[0]).cpu(), hidden[:, :h], (hidden[:, h:] if layers else None)


def features_file(folder: Path, layers: Sequence[int] = ()) -> Path:
    """Where ``build_features`` caches the features of ``layers`` (the answers are shared by all)."""
    return folder / ("features.safetensors" if not layers else f"features-l{'-'.join(map(str, layers))}.safetensors")


def build_features(loaded, config: DataConfig, folder: Path, log: Log, progress_bar,
                   layers: Sequence[int] = ()) -> Features:
    """Builds (or reads, when ``folder`` has them) the features of the self-distilled answers and the
    teacher-forced text.

    Args:
        loaded: the target as a ``LoadedModel`` (model and tokenizer).
        config: what goes into the data.
        folder: where the answers and features are cached.
        log: one-line status messages.
        progress_bar: ``(total, unit) -> bar`` with ``update(label)`` and ``close()``.
        layers: the target's layers whose outputs are kept besides the normed final state (a head
            fusing several layers reads them).
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = features_file(folder, layers)
    if path.exists():
        log(f"reading cached features from {path}")
        return Features(**load_file(str(path)))
    prompts = load_prompts(config.prompts or packaged_prompts())
    log(f"self-distillation: the target answers {len(prompts)} prompts, greedily and {config.sampled} times sampled "
        f"at temperature {config.temperature} (up to {config.max_new_tokens} tokens each)")
    bar = progress_bar(len(prompts) * (1 + config.sampled), "answers")
    rows = distill_answers(loaded, prompts, folder / "answers.jsonl", config, bar.update)
    bar.close()
    text = python_source_chunks(loaded.tokenizer, config.text_chunks, config.chunk_tokens)
    sequences = [(r["prompt_ids"] + r["answer_ids"], DISTILLED, len(r["prompt_ids"])) for r in rows]
    sequences += [(ids, TEXT, 0) for ids in text]
    log(f"target features of {len(sequences)} sequences ({len(text)} text chunks)")
    bar = progress_bar(len(sequences), "sequences")
    parts = []
    for ids, _, _ in sequences:
        parts.append(target_features(loaded.model, ids, layers))
        bar.update()
    bar.close()
    lengths = torch.tensor([len(ids) for ids, _, _ in sequences])
    data = Features(tokens=torch.tensor([t for ids, _, _ in sequences for t in ids]),
                    labels=torch.cat([p[0] for p in parts]), features=torch.cat([p[1] for p in parts]),
                    offsets=torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0))),
                    kinds=torch.tensor([k for _, k, _ in sequences]),
                    answer_starts=torch.tensor([a for _, _, a in sequences]),
                    layers=torch.cat([p[2] for p in parts]) if layers else None,
                    layer_ids=torch.tensor(list(layers)) if layers else None)
    tensors = {k: v.contiguous() for k, v in asdict(data).items() if v is not None}
    atomic_write(path, lambda tmp: save_file(tensors, tmp))
    log(f"cached {int(lengths.sum())} positions in {path} ({path.stat().st_size / 2**20:.0f} MiB)")
    return data
