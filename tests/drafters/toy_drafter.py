"""A toy drafter, written as a new drafter in ``src/specdecode/drafters/`` would be: it proposes the last token
again, ``k`` times (runs of spaces, ``=====``, repeated digits). ``docs/architecture.md`` §7 shows it as the
example of adding a drafter: this file, plus one line that imports it (in ``drafters/__init__.py``; here,
``test_toy_drafter.py``). It does not learn, keep a cache or read the target's features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.drafters.base import Draft, DrafterBase, StopRule
from specdecode.drafters.registry import DrafterSpec, register
from specdecode.sampling import SamplingParams


@dataclass
class RepeatDrafter(DrafterBase):
    """Drafts the sequence's last token ``k`` times: deterministic, so its q is one-hot (``Draft.q`` None)."""

    name: str = "repeat"
    drafts_past_unverified = True  # it reads only the sequence it is handed

    def propose(self, seq: list[int], k: int, sampling: SamplingParams, generator: torch.Generator,
                stop: StopRule | None = None) -> Draft:
        return Draft(seq[-1:] * k)


register(DrafterSpec("repeat", lambda inputs: RepeatDrafter(), "the last token again (a toy: docs/architecture.md §7)"))
