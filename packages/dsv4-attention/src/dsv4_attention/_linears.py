"""Linear layers of the core: plain bias-free ``torch.nn.Linear`` by default, any injected module otherwise.

The core calls every projection through :func:`linear_out`, so a module may return a tensor (``nn.Linear``) or
megatron's ``(output, bias)`` pair (the megatron adapter injects megatron / transformer-engine linears).
"""

from __future__ import annotations

import torch

from dsv4_primitives import RMSNorm


def linear_out(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, unwrapping a ``(output, bias)`` pair (the bias is always ``None`` here: no linear has one)."""
    y = module(x)
    return y[0] if isinstance(y, tuple) else y


def plain_linear(in_features: int, out_features: int, *, device=None, dtype=None) -> torch.nn.Linear:
    """A bias-free ``nn.Linear`` (``weight [out, in]``, PyTorch's default initialisation)."""
    return torch.nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)


def default_norm(hidden_size: int, eps: float, device=None) -> torch.nn.Module:
    """A weighted :class:`dsv4_primitives.RMSNorm` (fp32 math, weight 1) on ``device``."""
    norm = RMSNorm(hidden_size, eps=eps)
    return norm if device is None else norm.to(device)
