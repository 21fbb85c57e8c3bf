"""What each weight format costs in quality (docs/benchmarks/history.md, "Weights as stored and a fused step").

For each ``--weights`` format of one model (SmolLM2 by default):

- top-1 agreement with bf16: the bf16 model's greedy answers to the bench suites' prompts, teacher-forced
  through the format's model; the share of answer positions where both models' argmax is the same token;
- perplexity on held-out text: chunks of Python's own documentation (``pydoc_data/topics.py``, English
  prose that lies on any machine and that ``train-head`` never reads), teacher-forced;
- greedy agreement with llama.cpp on the same GGUF (where llama-cpp-python is installed): how many of the
  prompts' greedy answers are token-identical, and the mean length of the common prefix.

Prints a table, then one JSON line. Timings are not measured here (``specdecode bench`` does).

    .venv/bin/python benchmarks/weight_quality.py --formats bf16,q8_0,q4_1,q4_0,auto --limit 2
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
from pathlib import Path

import torch

from specdecode.bench.prompts import default_prompts, select
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.kv.cache import CacheConfig
from specdecode.models.backends import resolve_backend
from specdecode.models.build import from_checkpoint
from specdecode.models.loader import load_checkpoint
from specdecode.models.native import cpu_model
from specdecode.prompts import render
from specdecode.sampling import SamplingParams


def held_out_text(tokenizer, chunks: int, chunk_tokens: int) -> list[list[int]]:
    """``chunks`` consecutive pieces of ``chunk_tokens`` tokens of Python's topic documentation, each opening with
    BOS where the model wants one (as llama.cpp's perplexity tool starts its chunks)."""
    path = Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"
    ids = tokenizer.encode(path.read_text(encoding="utf-8"))
    bos = tokenizer.encode_prompt("")  # [BOS] or []
    step = chunk_tokens - len(bos)
    return [bos + ids[i * step:(i + 1) * step] for i in range(chunks) if len(ids) >= (i + 1) * step]


@torch.inference_mode()
def teacher_forced(model, ids: list[int]) -> torch.Tensor:
    """Logits ``[len(ids), V]`` of every position, in one forward."""
    cache = model.new_cache(CacheConfig(max_len=-(-len(ids) // 256) * 256))
    return model.forward_rows(torch.tensor(ids), cache, (0,), (len(ids),)).logits


def perplexity(model, chunks: list[list[int]]) -> float:
    nll, count = 0.0, 0
    for ids in chunks:
        logits = teacher_forced(model, ids)[:-1]
        nll += torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()
        count += len(ids) - 1
    return math.exp(nll / count)


def greedy(model, tokenizer, prompt: list[int], tokens: int) -> list[int]:
    engine = Engine(model, tokenizer, None, SpeculativeConfig(gamma=0))
    return engine.generate(prompt, SamplingParams(0.0), tokens).token_ids


def llamacpp_answers(path: str, prompts: list[list[int]], tokens: int, eos: frozenset[int]) -> list[list[int]] | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_threads=torch.get_num_threads(), verbose=False)
    out = []
    for prompt in prompts:
        llm.reset()
        ids: list[int] = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            ids.append(int(token))
            if token in eos or len(ids) == tokens:
                break
        out.append(ids)
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--formats", default="bf16,q8_0,q4_1,q4_0,auto")
    p.add_argument("--limit", type=int, default=2, help="prompts per bench category")
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--text-chunks", type=int, default=32)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(args.model)
    formats = args.formats.split(",")
    backend = resolve_backend("auto", torch.bfloat16, torch.device("cpu"))
    models = {"bf16": from_checkpoint(ckpt, torch.bfloat16, backend, weights="bf16")}
    for fmt in formats:
        if fmt not in models:
            models[fmt] = from_checkpoint(ckpt, torch.bfloat16, backend, weights=fmt)
    tokenizer = models["bf16"].tokenizer
    prompts = [render(x, tokenizer, chat=True) for x in select(default_prompts(), None, args.limit)]
    text = held_out_text(tokenizer, args.text_chunks, args.chunk_tokens)
    reference = models["bf16"].model
    answers = [greedy(reference, tokenizer, ids, args.answer_tokens) for ids in prompts]
    ref_top1 = [teacher_forced(reference, ids + ans).argmax(-1)[len(ids) - 1:-1] for ids, ans in zip(prompts, answers)]
    peer = llamacpp_answers(ckpt.source, prompts, args.answer_tokens, tokenizer.eos_token_ids) \
        if ckpt.source.endswith(".gguf") else None
    rows = []
    for fmt in formats:
        model = models[fmt].model
        same = total = 0
        for ids, ans, ref in zip(prompts, answers, ref_top1):
            top1 = teacher_forced(model, ids + ans).argmax(-1)[len(ids) - 1:-1]
            same += int((top1 == ref).sum())
            total += len(ans)
        row = {"format": fmt, "weights": model.weight_format, "weight_mb": round(model.weight_nbytes / 2**20, 1),
               "top1_agreement_with_bf16": round(same / total, 4), "positions": total,
               "perplexity": round(perplexity(model, text), 4), "text_tokens": sum(len(c) for c in text)}
        if peer is not None:
            ours = [greedy(model, tokenizer, ids, args.answer_tokens) for ids in prompts]
            row["llamacpp_identical"] = sum(a == b for a, b in zip(ours, peer))
            row["llamacpp_common_prefix"] = round(sum(common_prefix(a, b) for a, b in zip(ours, peer)) / len(peer), 2)
            row["prompts"] = len(peer)
        rows.append(row)
    print(f"{cpu_model()}, {args.model}: {len(prompts)} prompts x {args.answer_tokens} answer tokens, "
          f"perplexity over {rows[0]['text_tokens']} tokens of pydoc_data/topics.py")
    header = f"{'format':>6} {'weights':>22} {'MB':>7} {'top-1 vs bf16':>13} {'perplexity':>10}"
    print(header + (f" {'llama.cpp identical':>19} {'common prefix':>13}" if peer is not None else ""))
    for r in rows:
        line = (f"{r['format']:>6} {r['weights']:>22} {r['weight_mb']:>7.1f} {r['top1_agreement_with_bf16']:>13.4f} "
                f"{r['perplexity']:>10.3f}")
        if peer is not None:
            line += f" {r['llamacpp_identical']:>14}/{r['prompts']:<4} {r['llamacpp_common_prefix']:>13.2f}"
        print(line)
    print(json.dumps({"cpu": cpu_model(), "model": args.model, "answer_tokens": args.answer_tokens, "rows": rows}))


if __name__ == "__main__":
    main()
