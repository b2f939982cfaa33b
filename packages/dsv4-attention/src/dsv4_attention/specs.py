"""Deprecated path (dsv4-attention 0.2): the spec builders moved to :mod:`dsv4_attention.megatron.specs`.
Importing this module needs the ``[megatron]`` extra."""

from __future__ import annotations

import warnings

from dsv4_attention.megatron.specs import (
    DSv4TransformerLayer,
    csa_attention_spec,
    default_backend,
    get_core_attention_spec,
    get_dsv4_attention_spec,
    get_dsv4_layer_spec,
    hca_attention_spec,
    te_backend,
    window_attention_spec,
)

warnings.warn(
    "dsv4_attention.specs is deprecated: import the spec builders from dsv4_attention.megatron",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "DSv4TransformerLayer",
    "csa_attention_spec",
    "default_backend",
    "get_core_attention_spec",
    "get_dsv4_attention_spec",
    "get_dsv4_layer_spec",
    "hca_attention_spec",
    "te_backend",
    "window_attention_spec",
]
