"""Indexer KL loss (spec §5.2): full-denominator teacher over compressed entries vs softmax of index scores."""

from csa_kernels.ops.indexer_loss.interface import indexer_loss, indexer_loss_sbhd
from csa_kernels.ops.indexer_loss.reference import indexer_loss_ref, indexer_teacher_ref

__all__ = ["indexer_loss", "indexer_loss_ref", "indexer_loss_sbhd", "indexer_teacher_ref"]
