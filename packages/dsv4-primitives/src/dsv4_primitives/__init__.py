"""dsv4-primitives: keep-in-FP32 runtime (P1), partial interleaved RoPE / YaRN / inverse RoPE (P6), fp32 RMSNorm with a fused Triton path, fused vocab-parallel cross entropy, fused output head + cross entropy."""

from dsv4_primitives.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_ref
from dsv4_primitives.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_ref
from dsv4_primitives.precision import (
    KEEP_IN_FP32_ATTR,
    KeepFP32Mixin,
    convert_module_to_dtype_except_fp32_marked,
    fp8_disabled_context,
    is_keep_in_fp32,
    mark_keep_in_fp32,
)
from dsv4_primitives.rmsnorm import RMSNorm, rms_norm, rms_norm_ref
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

__version__ = "0.7.4"

__all__ = [
    "KEEP_IN_FP32_ATTR",
    "KeepFP32Mixin",
    "RMSNorm",
    "RopeConfig",
    "YarnConfig",
    "__version__",
    "apply_rope",
    "apply_rope_ref",
    "clear_rope_cache",
    "convert_module_to_dtype_except_fp32_marked",
    "fp8_disabled_context",
    "is_keep_in_fp32",
    "linear_cross_entropy",
    "linear_cross_entropy_ref",
    "mark_keep_in_fp32",
    "positions_from_cu_seqlens",
    "positions_sbhd",
    "rms_norm",
    "rms_norm_ref",
    "rope_angles",
    "rope_cos_sin",
    "rope_inv_freq",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_cross_entropy_ref",
    "yarn_ramp_bounds",
]
