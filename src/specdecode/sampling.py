"""Logits to probabilities: temperature, top-k, top-p and min-p, applied identically to target and draft; and the
logit processors that depend on what came before a row (:class:`Penalties`: OpenAI's presence and frequency
penalties, the repetition penalty, ``logit_bias``), applied to the target's verified rows.

Losslessness needs p (target) and q (draft) to be processed by the SAME function, so this is the only
place where that processing lives. Penalties stay exact under speculation because each verified row is penalized
by the tokens before *it*: the request's, then the drafted tokens on that row's path (its ancestors in a tree), so
that a row holds the logits plain decoding would have computed after the same tokens. It does not decide
acceptance (see ``verify.py``) or which rows a step verifies (``batch/``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


GREEDY_BELOW = 1e-5  # a temperature under this is greedy, as vLLM's: logits / 1e-300 overflow to inf - inf = NaN


@dataclass(frozen=True)
class Penalties:
    """What a request asks to be done to its logits before sampling.

    Args:
        presence: subtracted once from every token generated at least once (OpenAI: -2..2).
        frequency: subtracted per time a token was generated (OpenAI: -2..2).
        repetition: a token of the prompt or the output has its logit divided by this where positive, multiplied
            where negative (1 = off; > 1 discourages repeats; 0.01..100).
        bias: (token, value) pairs added to the logits (OpenAI's ``logit_bias``: -100..100).
    """

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not 0.01 <= self.repetition <= 100.0:  # logits divided by less would overflow float32 to inf
            raise ValueError(f"Penalties.repetition must be in [0.01, 100], got {self.repetition}")

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.bias)


def penalize(logits: torch.Tensor, penalties: Penalties, prompt: Sequence[int], generated: Sequence[int],
             paths: Sequence[Sequence[int]]) -> None:
    """Applies ``penalties`` in place to ``logits`` ``[rows, V]``: row r follows the prompt, the generated tokens and
    then the drafted tokens ``paths[r]`` (none for the row of the fed token)."""
    vocab, device = logits.shape[-1], logits.device
    counts = torch.zeros(len(paths), vocab, dtype=torch.float32, device=device)  # [rows, V] generated per row
    if generated:
        counts += torch.bincount(torch.tensor(generated, device=device), minlength=vocab)[:vocab].float()
    for row, path in enumerate(paths):
        if path:
            counts[row] += torch.bincount(torch.tensor(path, device=device), minlength=vocab)[:vocab].float()
    rows = logits.float()
    if penalties.repetition != 1.0:
        seen = counts > 0
        if prompt:
            seen[:, torch.tensor(sorted(set(prompt)), device=device)] = True
        scaled = torch.where(rows > 0, rows / penalties.repetition, rows * penalties.repetition)
        rows = torch.where(seen, scaled, rows)
    if penalties.frequency:
        rows = rows - penalties.frequency * counts
    if penalties.presence:
        rows = rows - penalties.presence * (counts > 0).float()
    if penalties.bias:
        ids = torch.tensor([t for t, _ in penalties.bias], device=device)
        rows[:, ids] += torch.tensor([b for _, b in penalties.bias], dtype=rows.dtype, device=device)
    logits.copy_(rows)


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen.

    Args:
        temperature: 0 (or below GREEDY_BELOW) means greedy (argmax); otherwise logits are divided by it.
        top_k: keep the k most likely tokens; 0 keeps all.
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1.0 keeps all.
        seed: seed of the request's random generator; None draws one from the global generator.
        min_p: drop tokens less likely than min_p times the most likely one (after top-k and top-p); 0 keeps all.
        penalties: the target's history-dependent logit processors (none by default).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    penalties: Penalties = field(default_factory=Penalties)

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or one so small (below GREEDY_BELOW) that dividing by it overflows."""
        return self.temperature < GREEDY_BELOW

    def request_seed(self) -> int:
        """The request's seed: ``seed``, or one drawn from the global generator when it is None."""
        return self.seed if self.seed is not None else int(torch.randint(2**62, (1,)).item())

    def generator(self, device: torch.device | str = "cpu", seed: int | None = None) -> torch.Generator:
        """A fresh generator for one request, seeded so that the same seed gives the same output.

        Args:
            device: where the tensors it samples live (the model's device): a CUDA tensor needs a CUDA
                generator. The same seed gives another stream on another device.
            seed: the request's seed (from :meth:`request_seed`); None = :meth:`request_seed`.
        """
        g = torch.Generator(device=device)
        g.manual_seed(self.request_seed() if seed is None else seed)
        return g


def argmax_ids(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``: each row's index of its largest logit, the first of tied ones (NaN counts as the
    largest), as a greedy step picks it. The same indices in a third of the time on CPU: torch vectorises a max over a
    dimension but not its argmax (torch 2.13, 2 threads: 8 rows of SmolLM2's 49152 logits 86 against 252 us, one row
    of Qwen's 151936 62 against 192 us; BENCHMARKS.md X-17))."""
    return logits.max(-1).indices


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turns logits ``[..., V]`` into the distribution tokens are drawn from.

    Args:
        logits: unnormalised scores, any leading shape.
        params: temperature / top-k / top-p / min-p; greedy gives a one-hot on the argmax.

    Returns:
        float32 probabilities of the same shape, each row summing to 1.
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, argmax_ids(logits).unsqueeze(-1), 1.0)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p; the top token always stays (a
        # top_p under float32's least value would otherwise drop it too, leaving nothing).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop_sorted[..., 0] = False
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    probs = logits.softmax(-1)
    if params.min_p > 0.0:  # the most likely token always stays
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


_MASK64 = (1 << 64) - 1


def position_generator(seed: int, position: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator keyed by (request seed, token position): the draw for a position is the same whichever
    step, draft length or batch it is made in (splitmix64 of the pair)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    g = torch.Generator(device=device)
    g.manual_seed(z ^ (z >> 31))
    return g


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draws one token per row of ``probs [N, V]``; returns ``[N]`` token ids."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
