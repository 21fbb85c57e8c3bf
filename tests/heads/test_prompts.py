"""The packaged head-training prompt set: valid, disjoint from the bench suites, and what its composer writes."""

from __future__ import annotations

import json
import re
from collections import Counter

from specdecode.bench.prompts import CATEGORIES, default_prompts
from specdecode.heads.data import packaged_prompts
from specdecode.prompts import load_prompts
from repo_scripts import load_script



def _text(p) -> str:
    return p.prompt if p.prompt is not None else "\n".join(m["content"] for m in p.messages)


def _spans(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def test_training_prompts_share_no_eight_word_span_with_the_bench_suites():
    bench = set().union(*(_spans(_text(p)) for p in default_prompts()))
    leaked = [p.id for p in load_prompts(packaged_prompts()) if _spans(_text(p)) & bench]
    assert leaked == []


def test_every_category_is_covered_and_ids_are_unique():
    prompts = load_prompts(packaged_prompts())
    counts = Counter(p.category for p in prompts)
    assert set(counts) == set(CATEGORIES) and min(counts.values()) >= 100
    assert len({p.id for p in prompts}) == len(prompts)
    assert len({_text(p) for p in prompts}) == len(prompts)  # no prompt twice under two ids


def test_the_composer_reproduces_the_packaged_composed_prompts():
    composer = load_script("tools/compose_head_prompts.py")
    rows = [json.loads(line) for line in packaged_prompts().read_text(encoding="utf-8").splitlines()]
    handwritten = [r for r in rows if not r["id"].startswith(composer.COMPOSED)]
    assert len(handwritten) == 420
    assert rows[len(handwritten):] == composer.compose(handwritten)
