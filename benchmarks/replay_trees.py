"""N-gram chains against n-gram trees without timing noise: greedy outputs replayed offline.

Greedy speculation emits the target's own greedy output whatever is drafted, so how many tokens a step
accepts can be replayed from that output alone: at each position the drafter proposes from prompt +
output so far, the draft is walked against the output (``verify_tree_greedy`` with the output as the
target's argmax), and the position advances by the accepted tokens plus one. This prints tau (tokens per
step) of ``ngram`` and ``ngram-tree`` at each draft size (tokens or tree nodes): a table, then one JSON
line. Timing is left out: a tree pays where its extra rows cost less than the tokens they add (see the
bench's verification curve v(k)).

    .venv/bin/python benchmarks/replay_trees.py --limit 6 --outputs /tmp/smol-outputs.json

``--outputs`` caches the plain greedy outputs (generated on first use: about 4 minutes for 42 prompts of
128 tokens on 2 cores).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdecode.bench.prompts import default_prompts, select
from specdecode.drafters import NgramDrafter, NgramTreeDrafter
from specdecode.engine import Engine
from specdecode.models.build import load_model
from specdecode.prompts import render
from specdecode.sampling import SamplingParams
from specdecode.tree import chain_parents, depths
from specdecode.verify import verify_tree_greedy

SIZES = (1, 2, 3, 4, 6, 8, 12)


def plain_outputs(model: str, limit: int, max_new_tokens: int, path: Path) -> list[dict]:
    """Prompt ids and plain greedy outputs of the bench suites (``limit`` per category), cached in ``path``."""
    if path.exists():
        return json.loads(path.read_text())
    lm = load_model(model, "auto", "cpu")
    engine = Engine(lm.model, lm.tokenizer)
    out = []
    for prompt in select(default_prompts(), limit=limit):
        ids = render(prompt, lm.tokenizer)
        out.append(dict(category=prompt.category, prompt=ids,
                        output=engine.generate(ids, max_new_tokens=max_new_tokens).token_ids))
        print(f"{prompt.id}: {len(ids)} prompt tokens, {len(out[-1]['output'])} generated", flush=True)
    path.write_text(json.dumps(out))
    return out


def tau(drafter, k: int, records: list[dict]) -> float:
    """Tokens per step over all records when every step drafts ``k`` tokens (or nodes)."""
    tokens = steps = 0
    for record in records:
        prompt, output = record["prompt"], record["output"]
        t = 0
        while t < len(output):
            draft = drafter.propose(prompt + output[:t], k, SamplingParams(), torch.Generator())
            parents = draft.parents if draft.parents is not None else chain_parents(len(draft.tokens))
            truth = output[t:t + len(draft.tokens) + 1]
            # The target's argmax at each row is the output token at that row's depth.
            best = [truth[0]] + [truth[d] if d < len(truth) else -1 for d in depths(parents)]
            t += verify_tree_greedy(best, draft.tokens, parents).accepted + 1
            steps += 1
        tokens += len(output)
    return tokens / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--limit", type=int, default=6, help="prompts per bench category")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--outputs", type=Path, required=True, help="cache of the plain greedy outputs (JSON)")
    args = p.parse_args()
    records = plain_outputs(args.model, args.limit, args.max_new_tokens, args.outputs)
    chain, trie = NgramDrafter(), NgramTreeDrafter()
    rows = [(k, tau(chain, k, records), tau(trie, k, records)) for k in SIZES]
    print(f"{len(records)} prompts, {sum(len(r['output']) for r in records)} generated tokens")
    print("size  ngram tau  ngram-tree tau  ratio")
    for k, a, b in rows:
        print(f"{k:4d}  {a:9.3f}  {b:14.3f}  {b / a:5.3f}")
    print(json.dumps({"prompts": len(records), "tau": {str(k): {"ngram": round(a, 4), "ngram-tree": round(b, 4)}
                                                        for k, a, b in rows}}))


if __name__ == "__main__":
    main()
