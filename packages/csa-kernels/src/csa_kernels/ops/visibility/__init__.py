"""Visibility (spec §3.4 M1, window M3) and candidate-index builders (global rows, -1 = empty)."""

from csa_kernels.ops.visibility.rules import (
    attention_indices,
    csa_dense_mask,
    indices_to_mask,
    visible_compressed_indices,
    visible_compressed_indices_sbhd,
    window_indices,
    window_indices_sbhd,
)

__all__ = [
    "attention_indices",
    "csa_dense_mask",
    "indices_to_mask",
    "visible_compressed_indices",
    "visible_compressed_indices_sbhd",
    "window_indices",
    "window_indices_sbhd",
]
