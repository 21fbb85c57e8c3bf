"""llama.cpp's ``llama-server`` (built by ``llamacpp_tools``) as a peer: started on a free loopback port with the
same GGUF and threads, asked for completions of token ids over HTTP, stopped afterwards. ``bench`` runs it
one request at a time for llama.cpp's plain decoding (``llamacpp-server``), its speculative decoding with the
same draft model (``llamacpp-server-draft``) and its n-gram lookup (``llamacpp-server-lookup``,
``--spec-type ngram-simple``); ``bench-serve`` runs it with ``--parallel`` slots.

It does not build the server (``llamacpp_tools.py``) or aggregate timings (``runner.py``).
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from specdecode.bench import llamacpp_tools
from specdecode.bench.child_server import Server
from specdecode.sampling import SamplingParams

LOOKUP_TYPE = "ngram-simple"  # llama.cpp's prompt lookup among its --spec-type choices
READY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ServerOptions:
    """How a llama-server peer runs.

    Args:
        model: the target GGUF file.
        threads: threads for generation and for prompt processing.
        ctx: context tokens per slot.
        slots: parallel slots (``--parallel``; continuous batching).
        draft: a draft model's GGUF file (speculative decoding), or None.
        lookup: draft with llama.cpp's n-gram prompt lookup (``LOOKUP_TYPE``).
        draft_max: most tokens drafted per step, with ``draft`` or ``lookup``.
        lookup_ngram: with ``lookup``, the length of the n-gram looked up (llama.cpp's default, 12, rarely
            matches in chat; the bench passes its own ``--ngram`` maximum).
    """

    model: Path
    threads: int
    ctx: int = 4096
    slots: int = 1
    draft: Path | None = None
    lookup: bool = False
    draft_max: int = 16
    lookup_ngram: int = 3

    def command(self, binary: Path, port: str) -> list[str]:
        """llama-server's command line listening on ``port`` (a number, or a placeholder another runner fills)."""
        cmd = [str(binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", port, "-t", str(self.threads),
               "-tb", str(self.threads), "-c", str(self.ctx * self.slots), "--parallel", str(self.slots),
               "--no-webui", "--log-disable"]
        if self.draft is not None:
            cmd += ["-md", str(self.draft), "--spec-draft-n-max", str(self.draft_max), "-td", str(self.threads)]
        if self.lookup:
            cmd += ["--spec-type", LOOKUP_TYPE, "--spec-ngram-simple-size-n", str(self.lookup_ngram),
                    "--spec-ngram-simple-size-m", str(self.draft_max)]
        return cmd


class LlamaServer:
    """A running llama-server child process (``child_server.Server``); a context manager that stops it on exit.

    Raises (on start):
        llamacpp_tools.PeerMissing: llama-server has not been built here.
        ServerFailed: it exited or did not become ready within READY_TIMEOUT_S (its output named).
    """

    def __init__(self, options: ServerOptions) -> None:
        binary = llamacpp_tools.require("llama-server")
        self.server = Server("llama-server", [], options.command(binary, "{port}"), ready="/health")
        self.url = self.server.url
        try:
            self.server.wait_ready(READY_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "LlamaServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.server.stop()

    def complete(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
                 seed: int) -> dict[str, Any]:
        """One /completion of ``prompt_ids``: its reply (``tokens``, ``stop_type``, ``timings``); the prompt is
        processed afresh (no prompt cache), as our bench's calls are."""
        body = {"prompt": list(prompt_ids), "n_predict": max_new_tokens, "return_tokens": True,
                "cache_prompt": False, "seed": seed, "temperature": 0.0 if sampling.greedy else sampling.temperature,
                "top_k": sampling.top_k or 0, "top_p": sampling.top_p, "min_p": 0.0, "repeat_penalty": 1.0}
        request = urllib.request.Request(f"{self.url}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            return json.loads(reply.read())
