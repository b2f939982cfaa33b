"""``RMSNorm`` module: a megatron-core spec norm module running :func:`dsv4_primitives.rmsnorm.apply.rms_norm`."""

from __future__ import annotations

import torch
from torch import nn

from dsv4_primitives.rmsnorm.apply import rms_norm


class RMSNorm(nn.Module):
    """RMSNorm module with an fp32-computed normalisation.

    Usable as a megatron-core spec module: ``RMSNorm(config=..., hidden_size=..., eps=...)`` matches the signature
    megatron's ``build_module`` passes to norm modules; ``config`` is optional and only read for
    ``layernorm_epsilon``. ``elementwise_affine=False`` gives the weightless variant. The forward is
    :func:`rms_norm` (fused Triton forward/backward on CUDA, the fp32 reference on CPU; ``backend`` as there).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float | None = None,
        config=None,
        elementwise_affine: bool = True,
        backend: str = "auto",
        **_unused,
    ) -> None:
        super().__init__()
        if hidden_size <= 0:
            raise ValueError(f"RMSNorm hidden_size must be positive, got {hidden_size}")
        if eps is None:
            eps = getattr(config, "layernorm_epsilon", 1e-6) if config is not None else 1e-6
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(hidden_size)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"RMSNorm expected last dim {self.hidden_size}, got shape {tuple(x.shape)}")
        return rms_norm(x, self.weight, self.eps, backend=self.backend)
