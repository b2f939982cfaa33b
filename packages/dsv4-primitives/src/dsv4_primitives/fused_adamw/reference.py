"""fp32 reference of :func:`~dsv4_primitives.fused_adamw.apply.fused_adamw_step`: torch ops in the order of torch's
single-tensor AdamW (``torch.optim.AdamW(foreach=False, fused=False)``, the oracle of the tests).

    g  = grad * clip
    p  = p (1 - lr wd)
    m  = lerp(m, g, 1 - beta1)
    v  = beta2 v + (1 - beta2) g^2
    p  = p - (lr / (1 - beta1^t)) m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    model = p rounded to the model param's dtype
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsv4_primitives.fused_adamw.apply import AdamWHyper


@torch.no_grad()
def fused_adamw_ref(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[int],
    hypers: Sequence[AdamWHyper],
    model_params: Sequence[torch.Tensor | None] | None = None,
    clip_coef: torch.Tensor | None = None,
) -> None:
    """The same in-place update as ``fused_adamw_step``, one tensor at a time with torch ops (any device)."""
    model_params = [None] * len(params) if model_params is None else model_params
    for p, g, m, v, t, h, dst in zip(
        params, grads, exp_avgs, exp_avg_sqs, steps, hypers, model_params, strict=True
    ):
        g = g.float() if clip_coef is None else g.float() * clip_coef.to(g.device)
        decay, w1, beta2, w2, step_size, bc2_sqrt, eps, _ = h.row(int(t))
        p.mul_(decay)
        m.lerp_(g, w1)
        v.mul_(beta2).addcmul_(g, g, value=w2)
        p.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(eps), value=-step_size)
        if dst is not None and dst.data_ptr() != p.data_ptr():
            dst.copy_(p.view_as(dst))


__all__ = ["fused_adamw_ref"]
