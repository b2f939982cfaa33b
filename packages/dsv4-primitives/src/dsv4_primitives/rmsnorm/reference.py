"""fp32 reference RMSNorm, weighted and weightless (dsv4-architecture.md §0).

    rstd = 1 / sqrt(mean(x^2, -1) + eps)                  # [...]     per row, fp32
    y    = w * (x * rstd)          (y = x * rstd without weight; computed in fp32, returned in x.dtype)

Gradients (what the fused kernel computes; autograd derives them from the code below):

    g  = dy * w                    (g = dy without weight)
    dx = rstd * (g - xhat * mean(g * xhat, -1)),  xhat = x * rstd
    dw = sum over all leading dims of dy * xhat    (fp32, returned in w.dtype)

The per-head query norm of DSv4 attention has no weight (``weight=None``).
"""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Reference RMSNorm over the last dim. ``x [..., D]``, ``weight [D]`` or ``None``; output dtype = ``x.dtype``.

    Computed in fp32 (in fp64 for fp64 inputs, so the reference can be gradchecked); differentiable through
    autograd with respect to ``x`` and ``weight``.
    """
    ct = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(ct)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        if weight.shape != x.shape[-1:]:
            raise ValueError(
                f"weight shape {tuple(weight.shape)} must be [{x.shape[-1]}] (the last dim of x)"
            )
        y = y * weight.to(ct)
    return y.to(x.dtype)
