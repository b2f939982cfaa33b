"""Deprecated location: use :mod:`dsv4_primitives.megatron.precision` (``pip install 'dsv4-primitives[megatron]'``).

This alias re-exports the same objects and warns once at import.
"""

import warnings

from dsv4_primitives.megatron.precision import (
    DistributedOptimizerWithNativeFP32Params,
    Float16ModuleKeepFP32,
    Float16OptimizerWithNativeFP32Params,
    fix_native_fp32_optimizer,
    get_megatron_optimizer_keep_fp32,
)

warnings.warn(
    "dsv4_primitives.precision.megatron is deprecated; import from dsv4_primitives.megatron.precision",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "DistributedOptimizerWithNativeFP32Params",
    "Float16ModuleKeepFP32",
    "Float16OptimizerWithNativeFP32Params",
    "fix_native_fp32_optimizer",
    "get_megatron_optimizer_keep_fp32",
]
