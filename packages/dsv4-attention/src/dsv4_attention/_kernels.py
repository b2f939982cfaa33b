"""The single import point of the csa-kernels ops this package uses (contract: csa-kernels ``API.md``).

Every number of the attention core comes from here: compressor pooling, window / visibility index builders,
lightning-indexer scores and top-k, sparse attention with sink, and the indexer KL loss. Each op dispatches to its
Triton kernel on CUDA (where csa-kernels has one) and to its fp32 PyTorch reference elsewhere.
"""

from __future__ import annotations

from csa_kernels import (
    StaticBounds,
    attention_indices,
    compressed_positions,
    compressor_pool,
    compressor_pool_sbhd,
    compressor_pool_static,
    indexer_loss,
    indexer_scores,
    indexer_scores_at,
    indexer_scores_static,
    indexer_topk,
    indexer_topk_ref,
    indexer_topk_static,
    sparse_attn,
    visible_compressed_indices,
    visible_compressed_indices_static,
    window_indices,
    window_indices_static,
)
from dsv4_primitives.varlen import compressed_cu_seqlens_host

__all__ = [
    "StaticBounds",
    "attention_indices",
    "compressed_cu_seqlens_host",
    "compressed_positions",
    "compressor_pool",
    "compressor_pool_sbhd",
    "compressor_pool_static",
    "indexer_loss",
    "indexer_scores",
    "indexer_scores_at",
    "indexer_scores_static",
    "indexer_topk",
    "indexer_topk_ref",
    "indexer_topk_static",
    "sparse_attn",
    "visible_compressed_indices",
    "visible_compressed_indices_static",
    "window_indices",
    "window_indices_static",
]
