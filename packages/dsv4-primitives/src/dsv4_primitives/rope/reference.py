"""fp32 PyTorch reference of partial interleaved RoPE (dsv4-architecture.md §2.3).

A head of width ``D`` is laid out ``[nope (D - r) | rope (r)]``. Pair ``i`` of the rope part is the complex number
``(x[D-r+2i], x[D-r+2i+1])``, rotated by angle ``pos * theta_i``:

    y[D-r+2i]   = x[D-r+2i] * cos - x[D-r+2i+1] * sin
    y[D-r+2i+1] = x[D-r+2i] * sin + x[D-r+2i+1] * cos

``inverse=True`` rotates by ``-pos`` (used to de-rotate the attention output at the query position). The first
``D - r`` channels are returned bit-identical. Math runs in fp32 (in fp64 for fp64 inputs, so callers can gradcheck)
and the result is cast back to ``x.dtype``.
"""

from __future__ import annotations

import torch

from dsv4_primitives.rope.frequencies import RopeConfig, rope_inv_freq


def rope_angles(
    cfg: RopeConfig, positions: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``positions.shape + [r/2]`` in ``dtype`` (angles formed in float64)."""
    ang = positions.to(torch.float64)[..., None] * rope_inv_freq(cfg, positions.device).double()
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope_ref(
    x: torch.Tensor, positions: torch.Tensor, cfg: RopeConfig, inverse: bool = False
) -> torch.Tensor:
    """Rotate the last ``cfg.rope_dim`` channels of ``x`` (out of place).

    Args:
        x: ``[*P, *H, D]`` where ``*P`` = ``positions.shape`` (e.g. ``[T]``, ``[S, B]``) and ``*H`` any head dims.
        positions: integer positions, shape ``*P`` (may be negative or exceed any cache).
        cfg: rotary configuration.
        inverse: rotate by ``-pos``.
    Returns:
        Tensor like ``x`` (computed in fp32, or fp64 for fp64 ``x``).
    """
    r = cfg.rope_dim
    ct = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for fp64 input
    cos, sin = rope_angles(cfg, positions, ct)  # [*P, r/2]
    extra = x.dim() - positions.dim() - 1
    cos = cos.reshape(*cos.shape[:-1], *([1] * extra), r // 2)
    sin = sin.reshape(*sin.shape[:-1], *([1] * extra), r // 2)
    if inverse:
        sin = -sin
    nope, rope = x[..., :-r], x[..., -r:].to(ct)
    a, b = rope[..., 0::2], rope[..., 1::2]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((nope, out.to(x.dtype)), dim=-1)
