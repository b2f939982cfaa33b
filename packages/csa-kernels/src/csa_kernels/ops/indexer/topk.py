"""The public-contract Triton form of ``indexer_topk``: validation, the launch plan of the boundaries' mode, and the
gradient of the selected scores.

Host boundaries plan the launches from their host copy (:func:`~csa_kernels.ops.indexer.triton.indexer_topk_triton`);
static boundaries plan them on the device (:func:`~csa_kernels.ops.indexer.device_plan.indexer_topk_device_planned`,
capturable). Either way the forward value is the selection pass's score and the backward is the fused
``indexer_scores_at`` kernel at the selected entries (no recomputation of the selection).
"""

from __future__ import annotations

import torch

from csa_kernels._checks import check_topk
from csa_kernels.ops.indexer.checks import check_inputs
from csa_kernels.ops.indexer.device_plan import indexer_topk_device_planned
from csa_kernels.ops.indexer.scores_at_autograd import attach_scores_at_grad
from csa_kernels.ops.indexer.triton import indexer_topk_triton
from dsv4_primitives.varlen import SeqBoundaries


def indexer_topk_checked(
    q_idx: torch.Tensor,  # [T, HI, DI]
    k_idx: torch.Tensor,  # [Tc, DI]
    weights: torch.Tensor,  # [T, HI]
    ratio: int,
    topk: int,
    bounds: SeqBoundaries,
    chunk_size: int | None = None,
    *,
    deterministic: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validates like the reference, selects with the plan of ``bounds``' mode and, when any input requires grad,
    attaches the gradient of the scores at the selected entries (forward value unchanged). No device -> host sync,
    forward or backward."""
    check_inputs(q_idx, k_idx, weights, ratio, bounds)
    check_topk(topk)
    select = indexer_topk_device_planned if bounds.is_static else indexer_topk_triton
    idx, vals = select(q_idx.detach(), k_idx.detach(), weights.detach(), ratio, topk, bounds, chunk_size)
    return idx, attach_scores_at_grad(vals, q_idx, k_idx, weights, idx, deterministic)
