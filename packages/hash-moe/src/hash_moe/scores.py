"""Router affinity scores (§7.2): ``sqrtsoftplus`` (DeepSeek-V4), ``sigmoid`` (V3) and ``softmax``, always in fp32.

Shape legend: ``N`` tokens, ``E`` routed experts.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

ScoreFunction = Literal["sqrtsoftplus", "sigmoid", "softmax"]
SCORE_FUNCTIONS: tuple[str, ...] = ("sqrtsoftplus", "sigmoid", "softmax")


def check_score_function(score_function: str) -> None:
    """Raise ValueError unless ``score_function`` is one of :data:`SCORE_FUNCTIONS`."""
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")


def routing_scores(logits: torch.Tensor, score_function: ScoreFunction) -> torch.Tensor:
    """Affinity scores ``s`` of every token for every expert, computed in fp32.

    ``sqrtsoftplus``: ``s = sqrt(log(1 + exp(z)))``; ``sigmoid``: ``s = 1 / (1 + exp(-z))``;
    ``softmax``: ``s = exp(z) / Σ_e exp(z_e)`` over the experts of each token.

    Args:
        logits: ``[N, E]`` gate logits ``z = u @ gate.weight.T`` (any float dtype; upcast here).
        score_function: one of :data:`SCORE_FUNCTIONS`.

    Returns:
        ``[N, E]`` fp32 scores (fp64 for fp64 logits; positive for all three functions).
    """
    check_score_function(score_function)
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if score_function == "sqrtsoftplus":
        # the floor keeps the gradient finite where softplus underflows to 0
        return F.softplus(z).clamp_min(torch.finfo(z.dtype).tiny).sqrt()
    if score_function == "sigmoid":
        return torch.sigmoid(z)
    return torch.softmax(z, dim=-1)
