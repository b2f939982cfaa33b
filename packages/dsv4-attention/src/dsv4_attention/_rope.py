"""The one RoPE entry point of this package: dsv4-primitives' dispatching ``apply_rope`` (reference fallback)."""

from __future__ import annotations

import torch

from dsv4_primitives import RopeConfig, apply_rope_ref

try:  # P6 dispatching op (Triton on CUDA); older dsv4-primitives only ship the reference
    from dsv4_primitives import apply_rope as _apply_rope
except ImportError:  # pragma: no cover - depends on the installed dsv4-primitives
    _apply_rope = None


def rope(x: torch.Tensor, positions: torch.Tensor, cfg: RopeConfig, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``cfg.rope_dim`` channels of ``x [*P, *H, D]`` at ``positions [*P]`` (out of place)."""
    if _apply_rope is None:
        return apply_rope_ref(x, positions, cfg, inverse=inverse)
    # eager torch path off-GPU: the Triton interpreter would only slow CPU runs down
    backend = "auto" if x.is_cuda else "torch"
    return _apply_rope(x, positions, cfg, inverse=inverse, backend=backend)
