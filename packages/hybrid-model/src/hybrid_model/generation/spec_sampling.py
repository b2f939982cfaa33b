"""The speculative-sampling acceptance rule (Leviathan et al. 2023; Chen et al. 2023), one drafted token per row.

A draft token ``x ~ q`` (the MTP head's sampling distribution) is verified against the main model's sampling
distribution ``p`` at the same position (both :func:`~hybrid_model.generation.sampling.token_probabilities`: the
same temperature and nucleus)::

    accept x  with probability  min(1, p(x) / q(x))                       (u ~ U[0, 1): accept iff u q(x) < p(x))
    rejected: the token is drawn from  r = max(p - q, 0) / sum(max(p - q, 0))

so the token that comes out is distributed exactly as ``p`` (``q(x) min(1, p/q) + (1 - sum_y min(p, q)) r(x) = p(x)``):
speculative sampling samples from the main model, only faster. Greedy verification (temperature 0) is the limit
``p``, ``q`` one-hot: accept iff the draft is the main model's argmax, else take the argmax.
"""

from __future__ import annotations

import torch


def accept_drafts(
    p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(accepted bool [B], token int64 [B])`` for draft tokens ``draft [B]`` drawn from ``q [B, V]``, verified
    against ``p [B, V]`` (module docstring): ``token`` is the draft where accepted, else a draw from the residual."""
    rows = torch.arange(draft.shape[0], device=draft.device)
    p_x, q_x = p[rows, draft], q[rows, draft]  # [B]
    u = torch.rand(draft.shape, generator=generator, device=p.device, dtype=p.dtype)  # [B]
    accepted = u * q_x < p_x
    residual = (p - q).clamp(min=0)  # [B, V]
    # a rejected draft has p(x) < q(x), so p != q and the residual has mass (> 0 up to rounding: fall back to p)
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > 0, residual, p)
    fallback = torch.multinomial(residual, 1, generator=generator)[:, 0]  # [B]
    return accepted, torch.where(accepted, draft, fallback)
