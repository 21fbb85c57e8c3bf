"""How much of a model's answer copies a prediction: what a prediction can be expected to draft.

A small model's greedy answer to an edit differs between kernel paths (their rounding differs), and so does how
much of it follows the original; the prediction tests hold the drafted share to what the answer copies.
"""

from __future__ import annotations

from difflib import SequenceMatcher

MIN_RUN = 3  # shorter shared runs are chance (a newline, an indent)


def copied_tokens(answer: list[int], prediction: list[int]) -> int:
    """Tokens of ``answer`` in runs of at least MIN_RUN tokens that also stand, in order, in ``prediction``."""
    blocks = SequenceMatcher(None, answer, prediction, autojunk=False).get_matching_blocks()
    return sum(b.size for b in blocks if b.size >= MIN_RUN)
