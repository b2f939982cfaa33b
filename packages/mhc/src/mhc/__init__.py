"""mhc: manifold-constrained hyper-connections (DSv4 §6, upstream P2) with fused Triton kernels.

Ops (dispatching, ``backend="auto"|"triton"|"reference"``, env ``MHC_BACKEND``): :func:`mhc_coefficients`,
:func:`mhc_pre`, :func:`mhc_collapse`, :func:`mhc_post`, :func:`hyper_head`, :func:`expand_streams`; fp32
references ``*_ref``; modules :class:`ManifoldHyperConnection`, :class:`HyperHead`, :class:`StreamExpansion` with
:class:`MHCConfig`. The megatron-core integration and pipeline transport (P3) live in :mod:`mhc.megatron`
(imported explicitly).
"""

from mhc.config import MHCConfig
from mhc.functional import expand_streams, hyper_head, mhc_coefficients, mhc_collapse, mhc_post, mhc_pre
from mhc.modules import HyperHead, ManifoldHyperConnection, StreamExpansion
from mhc.reference import (
    expand_streams_ref,
    hyper_head_ref,
    hyper_head_weights_ref,
    mhc_coefficients_ref,
    mhc_collapse_ref,
    mhc_mix_ref,
    mhc_post_ref,
    mhc_pre_ref,
    sinkhorn_ref,
)

__version__ = "0.4.0"

__all__ = [
    "HyperHead",
    "MHCConfig",
    "ManifoldHyperConnection",
    "StreamExpansion",
    "__version__",
    "expand_streams",
    "expand_streams_ref",
    "hyper_head",
    "hyper_head_ref",
    "hyper_head_weights_ref",
    "mhc_coefficients",
    "mhc_coefficients_ref",
    "mhc_collapse",
    "mhc_collapse_ref",
    "mhc_mix_ref",
    "mhc_post",
    "mhc_post_ref",
    "mhc_pre",
    "mhc_pre_ref",
    "sinkhorn_ref",
]
