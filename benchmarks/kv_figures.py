"""KV-cache figures that a per-prompt benchmark cannot give (docs/benchmarks/history.md, "Compressed KV cache").

1. bytes per cached token of each setting (scales and zero points included) vs bf16;
2. greedy agreement of a compressed target with the uncompressed one over 256 generated tokens;
3. prefill time saved by the prefix cache on 20 requests sharing a long system prompt;
4. a 4,000-token generation under a 512-token window with sinks: cache bytes and RSS along the way.

Acceptance, tau and tokens/s per setting come from ``specdecode bench --kv-dtype ...`` instead. Prints a
table per part, then one JSON line. It does not assert targets; it measures.

    .venv/bin/python benchmarks/kv_figures.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdecode.bench.prompts import default_prompts
from specdecode.bench.runner import current_rss_mb
from specdecode.engine import Engine
from specdecode.kv.cache import CacheConfig
from specdecode.kv.factory import make_cache
from specdecode.models.build import load_model
from specdecode.prompts import render

SETTINGS = {"bfloat16": CacheConfig(), "int8": CacheConfig(kv_dtype="int8"), "int4": CacheConfig(kv_dtype="int4"),
            "window 128 + 4 sinks": CacheConfig(window=128, sinks=4)}
GEOMETRIES = {"SmolLM2-135M (30 layers, 3 kv heads x 64)": (30, 3, 64),
              "Qwen2.5-1.5B (28 layers, 2 kv heads x 128)": (28, 2, 128)}


def bytes_per_token() -> dict:
    out = {}
    for name, (layers, heads, dim) in GEOMETRIES.items():
        base = make_cache(layers, heads, dim, CacheConfig(max_len=256), torch.bfloat16, "meta").bytes_per_token
        out[name] = {kv: {"bytes_per_token": make_cache(layers, heads, dim, CacheConfig(max_len=256, kv_dtype=kv),
                                                        torch.bfloat16, "meta").bytes_per_token}
                     for kv in ("bfloat16", "int8", "int4")}
        for kv, row in out[name].items():
            row["vs_bf16"] = round(row["bytes_per_token"] / base, 4)
            row["vs_fp32"] = round(row["bytes_per_token"] / (2 * base), 4)
    return out


def agreement(model, prompts: list[list[int]], tokens: int) -> dict:
    reference = [Engine(model.model, model.tokenizer).generate(p, max_new_tokens=tokens, eos_token_ids=()).token_ids
                 for p in prompts]
    out = {}
    for name, config in SETTINGS.items():
        if name == "bfloat16":
            continue
        engine = Engine(model.model, model.tokenizer, cache=config)
        same, first = [], []
        for p, ref in zip(prompts, reference):
            got = engine.generate(p, max_new_tokens=tokens, eos_token_ids=()).token_ids
            same.append(sum(a == b for a, b in zip(got, ref)) / tokens)
            first.append(next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), tokens))
        out[name] = {"identical_share_mean": round(statistics.mean(same), 4), "first_difference": first,
                     "identical_outputs": sum(f == tokens for f in first)}
    return out


def prefix_workload(model, requests: int = 20) -> dict:
    system = " ".join(p.prompt or "" for p in default_prompts()[:40] if p.category in ("rag", "summarization"))
    system = model.tokenizer.decode(model.tokenizer.encode(system)[:1000])
    questions = [f"Question {i}: in one sentence, what is point number {i} of the text above?" for i in range(requests)]
    out = {}
    for on in (False, True):
        engine = Engine(model.model, model.tokenizer, cache=CacheConfig(prefix_cache=on))
        engine.warmup()
        prefill, hits, ids = [], 0, []
        for q in questions:
            prompt = model.tokenizer.apply_chat_template([{"role": "system", "content": system},
                                                          {"role": "user", "content": q}])
            r = engine.generate(prompt, max_new_tokens=8)
            prefill.append(r.stats.prefill_s)
            hits += r.stats.prefix_hit_tokens
            ids.append(r.token_ids)
        out["on" if on else "off"] = {"prefill_s_total": round(sum(prefill), 3),
                                      "prefill_s_first": round(prefill[0], 4),
                                      "prefill_s_median_rest": round(statistics.median(prefill[1:]), 4),
                                      "prefix_hit_tokens": hits, "prompt_tokens": len(model.tokenizer.encode_prompt(prompt))}
        out["outputs_" + ("on" if on else "off")] = ids
    out["same_outputs"] = sum(a == b for a, b in zip(out.pop("outputs_on"), out.pop("outputs_off")))
    out["saved_share"] = round(1 - out["on"]["prefill_s_total"] / out["off"]["prefill_s_total"], 4)
    return out


def long_window(model, tokens: int, window: int, sinks: int) -> dict:
    engine = Engine(model.model, model.tokenizer, cache=CacheConfig(window=window, sinks=sinks))
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": "Tell a very long story about a lighthouse keeper."}])
    marks, next_mark, start = [], 250, time.perf_counter()
    stream = engine.stream(prompt, max_new_tokens=tokens, eos_token_ids=())
    for _ in stream:
        done = len(engine.generated)
        if done >= next_mark:
            marks.append({"tokens": done, "cache_nbytes": engine.cache.nbytes, "cache_bytes_used": engine.cache.bytes_used(0),
                          "rss_mb": round(current_rss_mb(), 1)})
            next_mark += 250
    seconds = time.perf_counter() - start
    return {"window": window, "sinks": sinks, "generated": len(stream.result.token_ids),
            "tokens_per_s": round(len(stream.result.token_ids) / seconds, 2), "marks": marks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per agreement run")
    ap.add_argument("--prompts", type=int, default=7, help="agreement prompts (one per category first)")
    ap.add_argument("--long", type=int, default=4000, help="tokens of the windowed generation")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    suite = default_prompts()
    firsts = list({p.category: p for p in reversed(suite)}.values())[:args.prompts]
    prompts = [render(p, model.tokenizer, chat=True) for p in firsts]
    doc = {"model": args.model, "bytes_per_token": bytes_per_token()}
    print("bytes per cached token (scales and zero points included):")
    for geo, rows in doc["bytes_per_token"].items():
        print(f"  {geo}: " + ", ".join(f"{kv} {r['bytes_per_token']:.0f} B ({r['vs_bf16']:.3f}x bf16, {r['vs_fp32']:.3f}x fp32)"
                                         for kv, r in rows.items()))
    doc["agreement"] = agreement(model, prompts, args.tokens)
    print(f"greedy agreement with the bf16 cache over {args.tokens} tokens ({len(prompts)} prompts):")
    for name, r in doc["agreement"].items():
        print(f"  {name:22s} identical positions {r['identical_share_mean']:.3f}, identical outputs "
              f"{r['identical_outputs']}/{len(prompts)}, first differences {r['first_difference']}")
    doc["prefix_cache"] = prefix_workload(model)
    pc = doc["prefix_cache"]
    print(f"prefix cache, 20 requests sharing a {pc['on']['prompt_tokens']}-token prompt: prefill {pc['off']['prefill_s_total']} s "
          f"off vs {pc['on']['prefill_s_total']} s on (saved {pc['saved_share']:.1%}); hit tokens {pc['on']['prefix_hit_tokens']}; "
          f"same outputs {pc['same_outputs']}/20")
    doc["long_window"] = long_window(model, args.long, 512, 4)
    lw = doc["long_window"]
    print(f"{lw['generated']} tokens under a {lw['window']}-token window + {lw['sinks']} sinks at {lw['tokens_per_s']} tok/s:")
    for m in lw["marks"][::4] + lw["marks"][-1:]:
        print(f"  after {m['tokens']:5d} tokens: cache {m['cache_nbytes'] / 2**20:.2f} MB allocated, "
              f"{m['cache_bytes_used'] / 2**20:.2f} MB held, RSS {m['rss_mb']} MB")
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
