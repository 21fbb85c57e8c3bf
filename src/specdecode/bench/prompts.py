"""The benchmark's prompt suites: the packaged ones (``bench/suites/<name>.jsonl``) and selection
by category and count. The file format, its validation and rendering are ``specdecode/prompts.py``'s.
This module does not run models.

The standard suites (CATEGORIES, one per category) are the default run. The extra suites (EXTRA_SUITES)
are packaged but run only when asked for: ``edit`` (small edits of a given text, each with the original
as its ``prediction``), ``agentic`` (sequences of requests that repeat one structure, as agents and
pipelines send them; ids ``agentic-<sequence>-NN``, file order is replay order), ``structured`` (requests
for JSON, each with the JSON schema its answer must follow: extraction from the prompt, and answers of the
model's own) and ``multilingual`` (chat in Chinese, Japanese, Korean, Russian and French: where a draft
vocabulary of a BPE vocabulary's first ids falls short).
"""

from __future__ import annotations

from importlib import resources
from typing import Iterable

from specdecode.prompts import Prompt, parse_prompts

# The packaged categories, in display order: Spec-Bench's six plus code. The default run.
CATEGORIES = ("multi_turn", "translation", "summarization", "qa", "math_reasoning", "rag", "code")
# Packaged suites not run by default (each suite's prompts have its name as category).
EXTRA_SUITES = ("edit", "agentic", "structured", "multilingual")


def packaged_prompts(suites: Iterable[str]) -> list[Prompt]:
    """The named packaged suites (``bench/suites/<name>.jsonl``, standard or extra), in the given order
    (a name given twice is read once).

    Raises:
        ValueError: a name that is not a packaged suite (the message lists the available ones).
    """
    suites = list(dict.fromkeys(suites))
    available = CATEGORIES + EXTRA_SUITES
    unknown = [s for s in suites if s not in available]
    if unknown:
        raise ValueError(f"no packaged suite {unknown}; available: {list(available)}")
    folder = resources.files("specdecode.bench") / "suites"
    out: list[Prompt] = []
    for name in suites:
        entry = folder / f"{name}.jsonl"
        out += parse_prompts(entry.read_text(encoding="utf-8").splitlines(), f"suites/{name}.jsonl")
    return out


def default_prompts() -> list[Prompt]:
    """The standard packaged suites (``bench/suites/<category>.jsonl``), in CATEGORIES order."""
    return packaged_prompts(CATEGORIES)


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
