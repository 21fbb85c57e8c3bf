"""A request's text as it is generated, for callers that iterate (``Engine.stream``). Not here: the
server's streaming (``serve/``), which reads each step's ``Output`` itself."""

from __future__ import annotations

from typing import Iterator

from specdecode.batch.sequence import GenerationResult, Output


class TextStream:
    """Iterates over text pieces as they are generated; ``result`` is set once iteration ends.

    The pieces are the sequence's showable text (``Sequence.output``): an incomplete UTF-8 character, and
    a tail that could still grow into a stop string, are held back until they are settled.
    """

    def __init__(self, outputs: Iterator[Output]) -> None:
        self._outputs = outputs
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        while True:
            try:
                out = next(self._outputs)
            except StopIteration as done:
                self.result = done.value
                return
            if out.text:
                yield out.text
