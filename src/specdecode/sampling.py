"""Logits to probabilities: temperature, top-k and top-p, applied identically to target and draft.

Losslessness needs p (target) and q (draft) to be processed by the SAME function, so this is the only
place where that processing lives. It does not decide acceptance (see ``verify.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


GREEDY_BELOW = 1e-5  # a temperature under this is greedy, as vLLM's: logits / 1e-300 overflow to inf - inf = NaN


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen.

    Args:
        temperature: 0 (or below GREEDY_BELOW) means greedy (argmax); otherwise logits are divided by it.
        top_k: keep the k most likely tokens; 0 keeps all.
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1.0 keeps all.
        seed: seed of the request's random generator; None draws one from the global generator.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")

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


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turns logits ``[..., V]`` into the distribution tokens are drawn from.

    Args:
        logits: unnormalised scores, any leading shape.
        params: temperature / top-k / top-p; greedy gives a one-hot on the argmax.

    Returns:
        float32 probabilities of the same shape, each row summing to 1.
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
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
    return logits.softmax(-1)


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
