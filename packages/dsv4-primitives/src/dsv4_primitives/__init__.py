"""dsv4-primitives: keep-in-FP32 runtime (P1), partial interleaved RoPE / YaRN / inverse RoPE (P6), fp32 RMSNorm."""

from dsv4_primitives.rmsnorm import RMSNorm, rms_norm_ref
from dsv4_primitives.rope import (
    RopeConfig,
    YarnConfig,
    apply_rope,
    apply_rope_ref,
    clear_rope_cache,
    positions_from_cu_seqlens,
    positions_sbhd,
    rope_angles,
    rope_cos_sin,
    rope_inv_freq,
    yarn_ramp_bounds,
)

__version__ = "0.1.0"

__all__ = [
    "RMSNorm",
    "RopeConfig",
    "YarnConfig",
    "__version__",
    "apply_rope",
    "apply_rope_ref",
    "clear_rope_cache",
    "positions_from_cu_seqlens",
    "positions_sbhd",
    "rms_norm_ref",
    "rope_angles",
    "rope_cos_sin",
    "rope_inv_freq",
    "yarn_ramp_bounds",
]
