"""Next-token choice from the last logits: greedy (temperature 0) or temperature + nucleus (top-p) sampling.

For ``logits [B, V]`` (fp32) of the sequences' last positions::

    temperature == 0:  next = argmax_v logits[b, v]                       (the first maximum on ties)
    otherwise:         p = softmax(logits / temperature)
                       nucleus = the most probable tokens, in descending order, up to and including the first one at
                                 which the cumulative probability reaches top_p (always at least one token)
                       next ~ p restricted to the nucleus, renormalised  (torch.multinomial with a seeded generator)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen.

    Attributes:
        temperature: 0 (greedy) or a finite value > 0 (divides the logits).
        top_p: nucleus mass in ``(0, 1]`` (1: the whole vocabulary); ignored when greedy.
        seed: seed of the sampling generator (``None``: torch's global generator; greedy decoding draws nothing).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, int | float) or not (math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(p, bool) or not isinstance(p, int | float) or not (0 < p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1] (1 = no nucleus truncation), got {p!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0
        ):
            raise ValueError(f"seed must be None or an int >= 0, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device) -> torch.Generator | None:
        """The sampling generator on ``device`` (``None``: greedy, or torch's global generator without a seed)."""
        if self.greedy or self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def token_probabilities(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """fp32 ``[B, V]``: the distribution sampling draws from (temperature softmax restricted to the nucleus,
    renormalised by ``torch.multinomial``; module docstring). Not for greedy configurations."""
    if cfg.greedy:
        raise ValueError("token_probabilities is the sampling distribution: temperature must be > 0")
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)  # [B, V]
    if cfg.top_p < 1:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of the more probable tokens
        sorted_p = torch.where(before < cfg.top_p, sorted_p, 0.0)  # the first token always stays
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return probs / probs.sum(dim=-1, keepdim=True)


def next_tokens(
    logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None
) -> torch.Tensor:
    """int64 ``[B]``: the next token of each row of ``logits [B, V]`` (module docstring)."""
    if cfg.greedy:
        return logits.float().argmax(dim=-1)
    return torch.multinomial(token_probabilities(logits, cfg), 1, generator=generator)[:, 0]
