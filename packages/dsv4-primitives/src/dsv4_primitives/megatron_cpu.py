"""Deprecated location: use :mod:`dsv4_primitives.megatron.cpu` (``pip install 'dsv4-primitives[megatron]'``).

This alias re-exports the same objects and warns once at import.
"""

import warnings

from dsv4_primitives.megatron.cpu import (
    apply_cpu_shims,
    cpu_shims,
    cpu_shims_applied,
    cuda_as_cpu,
    init_rng_tracker,
    remove_cpu_shims,
)

warnings.warn(
    "dsv4_primitives.megatron_cpu is deprecated; import from dsv4_primitives.megatron (or .megatron.cpu)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "apply_cpu_shims",
    "cpu_shims",
    "cpu_shims_applied",
    "cuda_as_cpu",
    "init_rng_tracker",
    "remove_cpu_shims",
]
