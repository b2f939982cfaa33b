"""Dense indexer scores through the fused score kernel (``indexer_scores_triton_checked``).

Forward: the fused Triton score pass of :mod:`csa_kernels.ops.indexer.triton` (never ``[T, HI, C]``).
Backward: recomputed through the chunked reference :func:`indexer_scores_ref` under autograd (the dense-phase
student is used only in the short dense warm-up of the indexer, so its gradient has no dedicated kernel); memory
stays bounded by the reference's row chunks.
"""

from __future__ import annotations

import torch

from csa_kernels.ops.indexer.checks import check_scores_inputs
from csa_kernels.ops.indexer.reference import indexer_scores_ref
from csa_kernels.ops.indexer.triton import indexer_scores_triton
from dsv4_primitives.varlen import SeqBoundaries


class IndexerScoresTritonFunction(torch.autograd.Function):
    """scores = indexer_scores(q_idx, k_idx, weights): fused forward, reference-recomputed backward."""

    @staticmethod
    def forward(ctx, q_idx, k_idx, weights, ratio, bounds, max_entries, chunk_size):
        ctx.save_for_backward(q_idx, k_idx, weights)
        ctx.args = (ratio, bounds, max_entries, chunk_size)
        cu, cuc = list(bounds.host), list(bounds.compressed(ratio).host)
        return indexer_scores_triton(q_idx, k_idx, weights, ratio, cu, cuc, max_entries)

    @staticmethod
    def backward(ctx, grad):
        q_idx, k_idx, weights = ctx.saved_tensors
        ratio, bounds, max_entries, chunk_size = ctx.args
        leaves = [
            x.detach().requires_grad_(need) for x, need in zip((q_idx, k_idx, weights), ctx.needs_input_grad)
        ]
        with torch.enable_grad():
            out = indexer_scores_ref(*leaves, ratio, bounds, max_entries, chunk_size)
            live = [x for x in leaves if x.requires_grad]
            grads = iter(
                torch.autograd.grad(out, live, grad.to(out.dtype), allow_unused=True) if live else ()
            )
        res = [next(grads) if x.requires_grad else None for x in leaves]
        res = [None if g is None else g.to(x.dtype) for g, x in zip(res, (q_idx, k_idx, weights))]
        return (*res, None, None, None, None)


def indexer_scores_triton_checked(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    ratio: int,
    bounds: SeqBoundaries,
    max_entries: int | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Public-contract form over HOST boundaries (validation and ``max_entries`` rule of
    :func:`indexer_scores_ref`); fp32 output. Neither the forward nor the backward does a device -> host sync."""
    max_entries = check_scores_inputs(q_idx, k_idx, weights, ratio, bounds, max_entries)
    return IndexerScoresTritonFunction.apply(q_idx, k_idx, weights, ratio, bounds, max_entries, chunk_size)
