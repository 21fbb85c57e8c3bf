"""``specdecode train-head``: builds the training data on this machine, trains a head, writes its file.

Parsing and orchestration only: data in ``data.py``, training in ``train.py``, the file in ``file.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from specdecode.argtypes import positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdecode.heads.train import TrainConfig

    d = TrainConfig()
    p.add_argument("--kind", choices=["eagle", "medusa"], default="eagle", help="head architecture (default eagle)")
    p.add_argument("--out", required=True, metavar="FILE", help="the head file to write (.safetensors)")
    p.add_argument("--epochs", type=positive_int, default=d.epochs, help=f"passes over the data (default {d.epochs})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    p.add_argument("--batch-tokens", type=positive_int, default=d.batch_tokens,
                   help=f"padded tokens per batch (default {d.batch_tokens})")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                   help=f"tokens the head may propose, the most frequent in the data; 0 = all (default {d.draft_vocab})")
    p.add_argument("--medusa-heads", type=positive_int, default=d.medusa_heads,
                   help=f"heads of a medusa head file (default {d.medusa_heads})")
    p.add_argument("--fuse-layers", default="none", metavar="none|eagle3|I,J,...",
                   help="EAGLE: the target features the head reads, side by side (EAGLE-3-style): layer outputs "
                        "0..L-1, L = the normed final state; 'eagle3' = layer 2's and the middle layer's outputs "
                        "and the normed final state; 'none' = the normed final state alone (EAGLE-1, default)")
    p.add_argument("--soft-labels", action="store_true",
                   help="EAGLE: cross-entropy against the target's distribution, not only its greedy guess")
    p.add_argument("--ce-weight", type=float, default=d.ce_weight,
                   help=f"EAGLE: weight of the cross-entropy (default {d.ce_weight})")
    p.add_argument("--regress", type=float, default=d.regress,
                   help=f"EAGLE: weight of the feature regression (default {d.regress}; 0 = none, as EAGLE-3)")
    p.add_argument("--unroll", type=positive_int, default=d.unroll,
                   help=f"EAGLE: draft steps trained on the head's own predictions (default {d.unroll})")
    p.add_argument("--seed", type=int, default=d.seed, help="shuffling, noise, initialisation, held-out split")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help="prompts the target answers for self-distillation (default: the packaged training set)")
    p.add_argument("--max-new-tokens", type=positive_int, default=192, help="length limit of each answer (default 192)")
    p.add_argument("--sampled", type=int, default=2,
                   help="sampled answers per prompt besides the greedy one, at temperature 0.8 (default 2)")
    p.add_argument("--text-chunks", type=int, default=150,
                   help="256-token chunks of Python's standard-library sources, teacher-forced (default 150)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="where answers and features are cached (default ~/.cache/specdecode/heads/<model, data>)")
    p.add_argument("--resume", action="store_true", help="continue from FILE.ckpt (written after every epoch)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def parse_fuse_layers(spec: str) -> tuple[int, ...] | None:
    """``--fuse-layers`` read before the model loads: () for "none", None for "eagle3" (the model's layer
    count decides), else the comma list's indices."""
    if spec in ("none", "eagle3"):
        return () if spec == "none" else None
    try:
        return tuple(int(part) for part in spec.split(","))
    except ValueError:
        raise ValueError(f"--fuse-layers {spec!r}: expected none, eagle3 or a comma list of layer indices") from None


def fuse_layers(spec: str, layers: tuple[int, ...] | None, num_layers: int) -> tuple[int, ...]:
    """``--fuse-layers`` (``spec``, read by ``parse_fuse_layers`` as ``layers``) for a ``num_layers``-layer
    target: its feature indices, checked."""
    from specdecode.heads.eagle import check_fuse_layers, eagle3_layers

    if layers is None:
        return eagle3_layers(num_layers)
    try:
        check_fuse_layers(layers, num_layers)
    except ValueError as err:
        raise ValueError(f"--fuse-layers {spec!r}: {err}") from None
    return layers


def _check_eagle_flags(args: argparse.Namespace) -> None:
    """EAGLE's training flags are refused with another kind, and a loss of nothing with EAGLE."""
    from specdecode.heads.train import TrainConfig

    d = TrainConfig()
    given = [flag for flag, value, default in (("--fuse-layers", args.fuse_layers, "none"),
                                               ("--soft-labels", args.soft_labels, False),
                                               ("--ce-weight", args.ce_weight, d.ce_weight),
                                               ("--regress", args.regress, d.regress),
                                               ("--unroll", args.unroll, d.unroll)) if value != default]
    if args.kind != "eagle" and given:
        raise ValueError(f"{', '.join(given)}: only for --kind eagle, not {args.kind}")
    for flag, value in (("--ce-weight", args.ce_weight), ("--regress", args.regress)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    if args.kind == "eagle" and args.ce_weight == 0 and args.regress == 0:
        raise ValueError("--ce-weight 0 and --regress 0 leave nothing to train")


def run_command(args: argparse.Namespace, log) -> int:
    from specdecode.heads.data import DataConfig, build_features
    from specdecode.heads.file import HeadFile, save_head, target_identity
    from specdecode.heads.train import TrainConfig, Trainer, train
    from specdecode.models.build import load_model
    from specdecode.models.fetch import cache_dir
    from specdecode.progress import ProgressBar
    from specdecode.prompts import load_prompts

    out = Path(args.out)
    if out.suffix != ".safetensors":
        raise ValueError(f"--out {out}: a head file is named *.safetensors")
    checkpoint = out.with_name(out.name + ".ckpt")
    if args.resume and not checkpoint.exists():
        raise ValueError(f"--resume: no checkpoint {checkpoint} to resume from")
    for flag, value in (("--sampled", args.sampled), ("--text-chunks", args.text_chunks),
                        ("--draft-vocab", args.draft_vocab)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    if args.prompts:
        load_prompts(args.prompts)  # a missing or malformed prompt file is refused before the model loads
    _check_eagle_flags(args)
    requested = parse_fuse_layers(args.fuse_layers)  # its syntax is refused before the model loads, its range after
    data_config = DataConfig(args.prompts, args.max_new_tokens, args.text_chunks, sampled=args.sampled)
    started = time.perf_counter()
    loaded = load_model(args.model, args.dtype, "cpu", progress=log, linear=args.linear, weights=args.weights)
    fuse = fuse_layers(args.fuse_layers, requested, loaded.model.config.num_layers) if args.kind == "eagle" else ()
    train_config = TrainConfig(kind=args.kind, epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens,
                               seed=args.seed, draft_vocab=args.draft_vocab, medusa_heads=args.medusa_heads,
                               unroll=args.unroll, ce_weight=args.ce_weight, regress=args.regress,
                               soft_labels=args.soft_labels, fuse_layers=fuse)
    identity = target_identity(loaded.model, loaded.source)
    key = data_config.key(identity["fingerprint"], loaded.model.weight_format)
    folder = Path(args.data_dir) if args.data_dir else cache_dir() / "heads" / key

    def bar(total: int, unit: str) -> ProgressBar:
        return ProgressBar(total, sys.stderr, enabled=not args.no_progress, unit=unit)

    data = build_features(loaded, data_config, folder, log, bar, fuse)
    data_s = time.perf_counter() - started
    trainer = Trainer(loaded.model, data, train_config, loaded.tokenizer.eos_token_ids)
    if args.resume:
        trainer.load_state(torch.load(checkpoint, weights_only=False))
        log(f"resuming after epoch {trainer.epoch} from {checkpoint}")
    log(f"training a {args.kind} head: {len(trainer.train_seqs)} sequences, {len(trainer.held_seqs)} held out, "
        f"draft vocabulary {trainer.vocab.numel()}")
    train_s = train(trainer, checkpoint, bar, log)
    recipe = {"command": "specdecode " + " ".join(sys.argv[1:]) if sys.argv else "", "data": asdict(data_config),
              "train": asdict(train_config), "positions": int(data.tokens.numel()), "sequences": len(data),
              "history": trainer.history, "data_seconds": round(data_s, 1), "train_seconds": round(train_s, 1),
              "threads": torch.get_num_threads()}
    # Stored in bf16 (half the bytes): drafting runs in the target's dtype, bf16 wherever our kernels run.
    weights = {n: t.to(torch.bfloat16) for n, t in trainer.head.state_dict().items()}
    save_head(out, HeadFile(args.kind, trainer.head_config(), identity, recipe, weights, trainer.ranking,
                            int(trainer.vocab.numel())))
    checkpoint.unlink(missing_ok=True)
    size = out.stat().st_size / 2**20
    log(f"wrote {out} ({size:.1f} MiB); data {data_s:.0f} s, training {train_s:.0f} s")
    return 0
