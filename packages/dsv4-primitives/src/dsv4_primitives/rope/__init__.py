"""Partial interleaved RoPE, YaRN (no mscale) and inverse RoPE (P6)."""

from dsv4_primitives.rope.frequencies import (
    RopeConfig,
    YarnConfig,
    rope_cos_sin,
    rope_inv_freq,
    yarn_ramp_bounds,
)
from dsv4_primitives.rope.positions import positions_from_cu_seqlens, positions_sbhd
from dsv4_primitives.rope.reference import apply_rope_ref, rope_angles

__all__ = [
    "RopeConfig",
    "YarnConfig",
    "apply_rope_ref",
    "positions_from_cu_seqlens",
    "positions_sbhd",
    "rope_angles",
    "rope_cos_sin",
    "rope_inv_freq",
    "yarn_ramp_bounds",
]
