"""Clamped SwiGLU (§7.3, P5) for routed and shared experts, computed in fp32.

```
a' = min(a, limit)                    # gate pre-activation: clipped from above only
b' = clamp(b, -limit, limit)          # linear ("up") pre-activation: clipped on both sides
h  = silu(a') · b'  (· p)             # p: optional per-token routing weight, multiplied in fp32 before w2
```

``limit = None`` is the plain SwiGLU (oracle E4). :func:`clamped_swiglu` takes the fc1 output ``[gate | up]``,
upcasts to fp32, and returns the input dtype; its backward recomputes the activation in fp32 from the saved
inputs (no fp32 intermediates are kept), with the clamp gradients of ``torch.clamp`` (pass-through where the
value is inside the closed interval). On CUDA (``backend="auto"``) the fused Triton kernels of
:mod:`hash_moe.kernels.swiglu_triton` do the same math in one pass each way (fp64 inputs keep the PyTorch path).

Shape legend: ``M`` rows (tokens, or token-expert pairs), ``F`` expert width.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from dsv4_primitives.dispatch import resolve_backend
from hash_moe.kernels.swiglu_triton import fused_clamped_swiglu


def check_swiglu_limit(limit: float | None) -> None:
    """Raise ValueError unless ``limit`` is None or finite and > 0."""
    if limit is not None and not (math.isfinite(limit) and limit > 0):
        raise ValueError(f"swiglu limit must be None or finite and > 0, got {limit}")


def clamped_swiglu_ref(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """Reference ``silu(min(gate, limit)) · clamp(up, -limit, limit)`` in the inputs' dtype (autograd-traced)."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


class _ClampedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, probs: torch.Tensor | None, limit: float | None) -> torch.Tensor:
        ctx.limit = limit
        ctx.has_probs = probs is not None
        ctx.save_for_backward(gate_up, probs)
        ct = _compute_dtype(gate_up)
        a, b = gate_up.to(ct).chunk(2, dim=-1)
        h = clamped_swiglu_ref(a, b, limit)  # [M, F] fp32 (fp64 for fp64 inputs)
        if probs is not None:
            h = h * probs.to(ct).unsqueeze(-1)
        return h.to(gate_up.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate_up, probs = ctx.saved_tensors
        limit = ctx.limit
        ct = _compute_dtype(gate_up)
        a, b = gate_up.to(ct).chunk(2, dim=-1)
        g = grad_out.to(ct)
        if limit is not None:
            a_c = a.clamp(max=limit)
            b_c = b.clamp(min=-limit, max=limit)
        else:
            a_c, b_c = a, b
        sig = torch.sigmoid(a_c)
        silu = a_c * sig
        grad_probs = None
        if ctx.has_probs:
            if ctx.needs_input_grad[1]:
                grad_probs = (g * silu * b_c).sum(dim=-1).to(probs.dtype)
            g = g * probs.to(ct).unsqueeze(-1)
        grad_a = g * b_c * sig * (1.0 + a_c * (1.0 - sig))
        grad_b = g * silu
        if limit is not None:
            grad_a = grad_a * (a <= limit)
            grad_b = grad_b * ((b >= -limit) & (b <= limit))
        grad_gate_up = torch.cat([grad_a, grad_b], dim=-1).to(gate_up.dtype)
        return grad_gate_up, grad_probs, None


SwiGLUBackend = Literal["auto", "triton", "reference"]
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def clamped_swiglu(
    gate_up: torch.Tensor,
    limit: float | None,
    probs: torch.Tensor | None = None,
    *,
    backend: SwiGLUBackend = "auto",
) -> torch.Tensor:
    """Clamped SwiGLU of ``gate_up = [gate | up]`` (``[..., 2F]``), optionally times ``probs`` (``[...]``).

    Computed in fp32 (fp64 for fp64 inputs), returned in ``gate_up.dtype``; differentiable in ``gate_up`` and ``probs``
    (``d probs`` in ``probs.dtype``).

    Args:
        gate_up: ``[..., 2F]`` fc1 output, gate half first.
        limit: the clamp ``L`` (``None`` = plain SwiGLU).
        probs: ``[...]`` per-row routing weight multiplied into ``h`` in fp32, or ``None``.
        backend: ``"reference"`` (the PyTorch ops of :class:`_ClampedSwiGLU`),
            ``"triton"`` (the fused one-pass kernels
            of :mod:`hash_moe.kernels.swiglu_triton`; not for fp64) or ``"auto"`` (Triton on CUDA unless
            ``gate_up`` is fp64, PyTorch otherwise).
    """
    check_swiglu_limit(limit)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even ([gate | up]), got {gate_up.shape[-1]}")
    if probs is not None and probs.shape != gate_up.shape[:-1]:
        raise ValueError(f"probs must be {tuple(gate_up.shape[:-1])}, got {tuple(probs.shape)}")
    backend = resolve_backend(backend, gate_up, op="hash_moe.clamped_swiglu", triton_dtypes=_TRITON_DTYPES)
    if backend == "triton":
        if gate_up.dtype == torch.float64:
            raise ValueError(
                "backend='triton' computes in fp32; fp64 gate_up takes the PyTorch path (backend='reference' or "
                "'auto')"
            )

        return fused_clamped_swiglu(gate_up, limit, probs)
    return _ClampedSwiGLU.apply(gate_up, probs, limit)
