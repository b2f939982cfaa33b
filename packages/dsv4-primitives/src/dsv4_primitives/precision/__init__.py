"""Selective FP32 runtime (P1). megatron-core integration lives in :mod:`dsv4_primitives.megatron.precision`
(the ``[megatron]`` extra)."""

from dsv4_primitives.precision.fp8 import fp8_disabled_context
from dsv4_primitives.precision.keep_fp32 import (
    KEEP_IN_FP32_ATTR,
    KeepFP32Mixin,
    convert_module_to_dtype_except_fp32_marked,
    is_keep_in_fp32,
    mark_keep_in_fp32,
)

__all__ = [
    "KEEP_IN_FP32_ATTR",
    "KeepFP32Mixin",
    "convert_module_to_dtype_except_fp32_marked",
    "fp8_disabled_context",
    "is_keep_in_fp32",
    "mark_keep_in_fp32",
]
