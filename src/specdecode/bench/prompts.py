"""The benchmark's prompt suites: the packaged ones (``bench/suites/<category>.jsonl``) and selection
by category and count. The file format, its validation and rendering are ``specdecode/prompts.py``'s.
This module does not run models.
"""

from __future__ import annotations

from importlib import resources
from typing import Iterable

from specdecode.prompts import Prompt, parse_prompts

# The packaged categories, in display order: Spec-Bench's six plus code.
CATEGORIES = ("multi_turn", "translation", "summarization", "qa", "math_reasoning", "rag", "code")


def default_prompts() -> list[Prompt]:
    """The packaged suites (``bench/suites/<category>.jsonl``), in CATEGORIES order."""
    folder = resources.files("specdecode.bench") / "suites"
    out: list[Prompt] = []
    for category in CATEGORIES:
        entry = folder / f"{category}.jsonl"
        out += parse_prompts(entry.read_text(encoding="utf-8").splitlines(), f"suites/{category}.jsonl")
    return out


def select(prompts: list[Prompt], categories: Iterable[str] | None = None, limit: int | None = None) -> list[Prompt]:
    """Keeps the given categories (all when None) and at most ``limit`` prompts of each, in file order.

    Raises:
        ValueError: a requested category that no prompt has.
    """
    known = list(dict.fromkeys(p.category for p in prompts))
    wanted = list(categories) if categories else known
    unknown = [c for c in wanted if c not in known]
    if unknown:
        raise ValueError(f"--categories: no prompts in {unknown}; the prompts have {known}")
    taken: dict[str, int] = {}
    out = []
    for p in prompts:
        if p.category in wanted and (limit is None or taken.get(p.category, 0) < limit):
            taken[p.category] = taken.get(p.category, 0) + 1
            out.append(p)
    return out
