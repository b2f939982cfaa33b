"""The single import point of the csa-kernels ops this package uses (contract: csa-kernels ``API.md``).

Every number of the attention core comes from here: compressor pooling, window / visibility index builders,
lightning-indexer scores and top-k, sparse attention with sink, and the indexer KL loss. The ops take the documents
as one ``dsv4_primitives.varlen.SeqBoundaries`` (host or static: the CUDA-graph mode is a property of the
boundaries, not a second set of ops). Each op dispatches to its
Triton kernel on CUDA (where csa-kernels has one) and to its fp32 PyTorch reference elsewhere.
"""

from __future__ import annotations

from csa_kernels import (
    attention_indices,
    compressed_positions,
    compressor_pool,
    compressor_pool_sbhd,
    indexer_loss,
    indexer_scores,
    indexer_scores_at,
    indexer_topk,
    sparse_attn,
    visible_compressed_indices,
    window_indices,
)

__all__ = [
    "attention_indices",
    "compressed_positions",
    "compressor_pool",
    "compressor_pool_sbhd",
    "indexer_loss",
    "indexer_scores",
    "indexer_scores_at",
    "indexer_topk",
    "sparse_attn",
    "visible_compressed_indices",
    "window_indices",
]
