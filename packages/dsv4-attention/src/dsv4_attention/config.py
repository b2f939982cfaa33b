"""Deprecated path (dsv4-attention 0.2): the megatron config moved to :mod:`dsv4_attention.megatron.config`, the
layer kinds to :mod:`dsv4_attention.kind`. Importing this module needs the ``[megatron]`` extra."""

from __future__ import annotations

import warnings

from dsv4_attention.kind import LAYER_KINDS, VALID_COMPRESS_RATIOS, check_compress_ratio
from dsv4_attention.megatron.config import DSv4AttentionConfig

warnings.warn(
    "dsv4_attention.config is deprecated: import DSv4AttentionConfig from dsv4_attention.megatron and "
    "LayerKind / check_compress_ratio from dsv4_attention",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["LAYER_KINDS", "VALID_COMPRESS_RATIOS", "DSv4AttentionConfig", "check_compress_ratio"]
