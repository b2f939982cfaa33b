"""Autograd binding of the fused indexer KL loss (``indexer_loss_triton``): gradient only into the index scores."""

from __future__ import annotations

import torch

from csa_kernels.ops.indexer_loss.checks import check_inputs
from csa_kernels.ops.indexer_loss.triton import indexer_loss_bwd, indexer_loss_fwd


class IndexerLossTritonFunction(torch.autograd.Function):
    """per_row_kl = KL(teacher(q, kv_all, lse) || softmax(index_scores)); saves the teacher log-mass ``[T, Kc]``."""

    @staticmethod
    def forward(ctx, q, kv_all, lse, comp_indices, index_scores, softmax_scale):
        kl, lm, stats = indexer_loss_fwd(q, kv_all, lse, comp_indices, index_scores, softmax_scale)
        ctx.save_for_backward(index_scores, lm, stats)
        return kl

    @staticmethod
    def backward(ctx, g):
        index_scores, lm, stats = ctx.saved_tensors
        return None, None, None, None, indexer_loss_bwd(index_scores, lm, stats, g), None


def indexer_loss_triton(
    q: torch.Tensor,  # [T, H, D]
    kv_all: torch.Tensor,  # [Nkv, D]
    attn_sink: torch.Tensor,  # [H] (shape-checked only)
    lse: torch.Tensor,  # [T, H]
    comp_indices: torch.Tensor,  # [T, Kc]
    index_scores: torch.Tensor,  # [T, Kc]
    softmax_scale: float,
    *,
    check_indices: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused Triton form of :func:`~csa_kernels.ops.indexer_loss.reference.indexer_loss_ref`: ``(loss, per_row_kl
    [T])`` in fp32; ``q``, ``kv_all``, ``lse`` are detached, ``index_scores`` gets ``(softmax - teacher) * dKL``.
    ``check_indices=False`` skips the range check of ``comp_indices`` (its device -> host sync)."""
    check_inputs(q, kv_all, attn_sink, lse, comp_indices, index_scores, softmax_scale, check_indices)
    per_row = IndexerLossTritonFunction.apply(
        q.detach(), kv_all.detach(), lse.detach(), comp_indices, index_scores, float(softmax_scale)
    )
    n_rows = (comp_indices >= 0).any(1).sum().clamp(min=1)  # rows with entries (no host sync)
    return per_row.sum() / n_rows, per_row
