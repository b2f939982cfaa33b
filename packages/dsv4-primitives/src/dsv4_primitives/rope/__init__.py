"""Partial interleaved RoPE, YaRN (no mscale) and inverse RoPE (P6)."""

from dsv4_primitives.rope.apply import apply_rope
from dsv4_primitives.rope.frequencies import (
    RopeConfig,
    YarnConfig,
    clear_rope_cache,
    rope_cos_sin,
    rope_inv_freq,
    yarn_ramp_bounds,
)
from dsv4_primitives.rope.positions import positions_from_cu_seqlens, positions_sbhd
from dsv4_primitives.rope.reference import apply_rope_ref, rope_angles

__all__ = [
    "RopeConfig",
    "YarnConfig",
    "apply_rope",
    "apply_rope_ref",
    "clear_rope_cache",
    "positions_from_cu_seqlens",
    "positions_sbhd",
    "rope_angles",
    "rope_cos_sin",
    "rope_inv_freq",
    "yarn_ramp_bounds",
]
