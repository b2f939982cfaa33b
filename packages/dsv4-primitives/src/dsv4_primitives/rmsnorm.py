"""fp32 RMSNorm, weighted and weightless (dsv4-architecture.md §0).

    RMSNorm_w(x) = w * x / sqrt(mean(x^2, -1) + eps)      (computed in fp32, returned in x.dtype)

The per-head query norm of DSv4 attention has no weight (``weight=None``).
"""

from __future__ import annotations

import torch
from torch import nn


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


class RMSNorm(nn.Module):
    """RMSNorm module with an fp32-computed normalisation.

    Usable as a megatron-core spec module: ``RMSNorm(config=..., hidden_size=..., eps=...)`` matches the signature
    megatron's ``build_module`` passes to norm modules; ``config`` is optional and only read for
    ``layernorm_epsilon``. ``elementwise_affine=False`` gives the weightless variant.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float | None = None,
        config=None,
        elementwise_affine: bool = True,
        **_unused,
    ) -> None:
        super().__init__()
        if hidden_size <= 0:
            raise ValueError(f"RMSNorm hidden_size must be positive, got {hidden_size}")
        if eps is None:
            eps = getattr(config, "layernorm_epsilon", 1e-6) if config is not None else 1e-6
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(hidden_size)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"RMSNorm expected last dim {self.hidden_size}, got shape {tuple(x.shape)}")
        return rms_norm_ref(x, self.weight, self.eps)
