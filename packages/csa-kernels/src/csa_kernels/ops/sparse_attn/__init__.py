"""Shared-KV sparse attention with a per-head sink (spec §2.2): gather form, dense masked oracle, SBHD wrapper."""

from csa_kernels.ops.sparse_attn.interface import local_to_global_rows, sparse_attn, sparse_attn_sbhd
from csa_kernels.ops.sparse_attn.reference import sparse_attn_dense_ref, sparse_attn_ref

__all__ = [
    "local_to_global_rows",
    "sparse_attn",
    "sparse_attn_dense_ref",
    "sparse_attn_ref",
    "sparse_attn_sbhd",
]
