"""Static-bounds (CUDA-graph) forms of the lightning-indexer ops: document bounds on the device, capacities on the
host (:mod:`csa_kernels.static_bounds`).

* :func:`indexer_topk_static`: the fused score kernel of :mod:`.triton` launched over a row-block table built on
  the device (:func:`~csa_kernels.static_bounds.row_block_table`, a fixed number of slots, unused ones empty) and the
  streaming top-k of :mod:`.topk_streaming` over the entry capacity ``T // ratio`` (tiles past a block's visible
  entries are skipped by the kernel). Query rows are processed in fixed chunks of ``chunk_size`` rows (a multiple
  of the kernel's row block); with one chunk (``chunk_size >= T``, the default whenever ``T * (tile + topk)`` fits
  ``TILE_ELEMENTS``) the row blocks are the host-bounds plan's and the result is bitwise the host-bounds result.
* :func:`indexer_scores_static`: dense scores ``[T, T // ratio]`` (column = local entry) as
  :func:`~csa_kernels.indexer_scores_at` at the visible entries (fused forward and backward, no bounds at all).
"""

from __future__ import annotations

import torch

from csa_kernels._checks import check_topk
from csa_kernels._triton_utils import check_triton_device
from csa_kernels.ops.indexer.checks import check_scores_at_inputs
from csa_kernels.ops.indexer.interface import indexer_scores_at
from csa_kernels.ops.indexer.reference import indexer_topk_ref
from csa_kernels.ops.indexer.scores_at_autograd import attach_scores_at_grad
from csa_kernels.ops.indexer.topk_streaming import ENTRY_TILE, TILE_ELEMENTS, stream_chunk_topk
from csa_kernels.ops.indexer.triton import _launch_scores, _prepare_inputs
from csa_kernels.static_bounds import StaticBounds, row_block_table, visible_compressed_indices_static
from dsv4_primitives.dispatch import resolve_backend


def indexer_topk_static(
    q_idx: torch.Tensor,  # [T, HI, DI]
    k_idx: torch.Tensor,  # [T // ratio, DI]
    weights: torch.Tensor,  # [T, HI]
    ratio: int,
    topk: int,
    bounds: StaticBounds,
    *,
    backend: str = "auto",
    chunk_size: int | None = None,
    deterministic: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~csa_kernels.indexer_topk` of a static-shape pack: ``(indices [T, topk] int32 global entry rows,
    scores [T, topk])``, same selection and tie rule, scores differentiable in the inputs (Triton: the fused
    ``indexer_scores_at`` backward, as in the host-bounds form). ``k_idx`` holds the capacity ``T // ratio`` rows
    (padding rows are never selected). Reference backend (CPU; never captured): reads the bounds back."""
    check_topk(topk)
    _check_rows(q_idx, k_idx, bounds, ratio)
    if resolve_backend(backend, q_idx, k_idx, op="csa_kernels.indexer_topk") != "triton":
        return _topk_reference(q_idx, k_idx, weights, ratio, topk, bounds, chunk_size)

    no_indices = torch.empty(q_idx.shape[0], 0, dtype=torch.int32)  # shape-only: the checks read no values
    check_scores_at_inputs(q_idx, k_idx, weights, no_indices, False)
    idx, vals = _topk_triton(
        q_idx.detach(), k_idx.detach(), weights.detach(), ratio, topk, bounds, chunk_size
    )
    return idx, attach_scores_at_grad(vals, q_idx, k_idx, weights, idx, deterministic)


def _check_rows(q_idx, k_idx, bounds: StaticBounds, ratio: int) -> None:
    if q_idx.shape[0] != bounds.total or k_idx.shape[0] != bounds.entry_capacity(ratio):
        raise ValueError(
            f"static bounds of {bounds.total} rows need q_idx [{bounds.total}, HI, DI] and k_idx "
            f"[{bounds.entry_capacity(ratio)}, DI] (T // ratio), got {tuple(q_idx.shape)} and {tuple(k_idx.shape)}"
        )


def _topk_triton(q_idx, k_idx, weights, ratio, topk, bounds: StaticBounds, chunk_size, entry_tile=None):
    check_triton_device(q_idx, k_idx, weights)
    t, cap = bounds.total, bounds.entry_capacity(ratio)
    indices = torch.full((t, topk), -1, dtype=torch.int32, device=q_idx.device)
    values = torch.full((t, topk), float("-inf"), dtype=torch.float32, device=q_idx.device)
    if t == 0 or cap == 0:
        return indices, values
    q_idx, k_idx, weights, cfg = _prepare_inputs(q_idx, k_idx, weights)
    block_t = cfg[0]
    tile = min(entry_tile or ENTRY_TILE, cap)
    if chunk_size is None:
        chunk_size = max(block_t, TILE_ELEMENTS // max(tile + topk, 1))
    chunk = -(-chunk_size // block_t) * block_t  # whole kernel row blocks
    cuc = bounds.compressed(ratio).to(torch.int64)
    doc = bounds.document_ids()
    for r0 in range(0, t, chunk):  # fixed host loop: the chunks depend on T only
        r1 = min(t, r0 + chunk)
        meta = row_block_table(bounds, ratio, block_t, r0, r1)  # [5, S] on the device
        width = min(cap, r1 // ratio)  # no row of the chunk sees more entries

        def score_tile(c0, c1, meta=meta, r0=r0, r1=r1):
            buf = torch.full((r1 - r0, c1 - c0), float("-inf"), dtype=torch.float32, device=q_idx.device)
            _launch_scores(q_idx, k_idx, weights, buf, meta, r0, ratio, c1, cfg, col0=c0)
            return buf

        if width == 0:
            continue
        vals, cols = stream_chunk_topk(score_tile, r1 - r0, width, topk, tile, q_idx.device)
        k = vals.shape[1]
        entry0 = cuc[doc[r0:r1]]  # [rows] first entry of each row's document
        indices[r0:r1, :k] = torch.where(torch.isneginf(vals), -1, cols + entry0[:, None]).to(torch.int32)
        values[r0:r1, :k] = vals
    return indices, values


def _topk_reference(q_idx, k_idx, weights, ratio, topk, bounds: StaticBounds, chunk_size):
    cu = [int(v) for v in bounds.cu_seqlens.tolist()]
    cuc_t = bounds.compressed(ratio)
    cuc = [int(v) for v in cuc_t.tolist()]
    return indexer_topk_ref(
        q_idx,
        k_idx[: cuc[-1]],
        weights,
        ratio,
        topk,
        bounds.cu_seqlens,
        cuc_t,
        chunk_size,
        cu_seqlens_host=cu,
        cu_seqlens_c_host=cuc,
    )


def indexer_scores_static(
    q_idx: torch.Tensor,  # [T, HI, DI]
    k_idx: torch.Tensor,  # [T // ratio, DI]
    weights: torch.Tensor,  # [T, HI]
    ratio: int,
    bounds: StaticBounds,
    *,
    backend: str = "auto",
    deterministic: bool | None = None,
) -> torch.Tensor:
    """Dense index scores ``[T, T // ratio]`` of a static-shape pack (column = local entry, ``-inf`` where not
    visible): :func:`~csa_kernels.indexer_scores` at the capacity width, differentiable, no host read."""
    _check_rows(q_idx, k_idx, bounds, ratio)
    visible = visible_compressed_indices_static(bounds, ratio)  # [T, T // ratio] global entry rows, -1 padded
    return indexer_scores_at(
        q_idx, k_idx, weights, visible, backend=backend, check_indices=False, deterministic=deterministic
    )


__all__ = ["indexer_scores_static", "indexer_topk_static"]
