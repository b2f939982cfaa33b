"""Packed-layout (THD, flash-attn varlen) helpers: a compatibility re-export of :mod:`dsv4_primitives.varlen`.

Everything here moved to :mod:`dsv4_primitives.varlen` (one varlen module for every package); import from there in
new code. The names below stay importable from ``csa_kernels.varlen`` and ``csa_kernels``.
"""

from dsv4_primitives.varlen import (
    compressed_cu_seqlens,
    compressed_cu_seqlens_host,
    cu_seqlens_from_lengths,
    document_ids,
    document_positions,
    sbhd_cu_seqlens,
    sbhd_cu_seqlens_host,
    sbhd_to_thd,
    thd_to_sbhd,
    upload_host_ints,
)

__all__ = [
    "compressed_cu_seqlens",
    "compressed_cu_seqlens_host",
    "cu_seqlens_from_lengths",
    "document_ids",
    "document_positions",
    "sbhd_cu_seqlens",
    "sbhd_cu_seqlens_host",
    "sbhd_to_thd",
    "thd_to_sbhd",
    "upload_host_ints",
]
