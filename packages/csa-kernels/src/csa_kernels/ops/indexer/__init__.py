"""Lightning indexer (spec §4): ReLU-weighted multi-head scores over visible compressed entries, chunked top-k."""

from csa_kernels.ops.indexer.interface import (
    indexer_scores,
    indexer_scores_at,
    indexer_scores_sbhd,
    indexer_topk,
    indexer_topk_sbhd,
)
from csa_kernels.ops.indexer.reference import indexer_scores_at_ref, indexer_scores_ref, indexer_topk_ref

__all__ = [
    "indexer_scores",
    "indexer_scores_at",
    "indexer_scores_at_ref",
    "indexer_scores_ref",
    "indexer_scores_sbhd",
    "indexer_topk",
    "indexer_topk_ref",
    "indexer_topk_sbhd",
]
