"""The lightning-indexer top-k over STATIC boundaries (CUDA graphs): every launch planned on the device.

With static :class:`~dsv4_primitives.varlen.SeqBoundaries` the boundaries exist on the device only and every shape
comes from the capacities (``T`` rows, ``N + 1`` document slots, ``T // ratio`` entries). The fused score kernel of
:mod:`.triton` is launched over a row-block table built on the device (:func:`row_block_table`, a fixed number of
slots, unused ones empty) and the streaming top-k of :mod:`.topk_streaming` runs over the entry capacity (tiles
past a block's visible entries are skipped by the kernel). Query rows are processed in fixed chunks of
``chunk_size`` rows (a multiple of the kernel's row block); with one chunk (``chunk_size >= T``, the default
whenever ``T * (tile + topk)`` fits ``TILE_ELEMENTS``) the row blocks are the host plan's and the result is bitwise
the host-boundaries result. Nothing is read back: capturable, and the capture replays correctly on other packs.

Shape legend: ``T`` rows, ``N`` document slots, ``S`` row-block slots.
"""

from __future__ import annotations

import torch

from csa_kernels._triton_utils import check_triton_device
from csa_kernels.ops.indexer.topk_streaming import ENTRY_TILE, TILE_ELEMENTS, stream_chunk_topk
from csa_kernels.ops.indexer.triton import _launch_scores, _prepare_inputs
from dsv4_primitives.varlen import SeqBoundaries


def row_block_table(
    bounds: SeqBoundaries, ratio: int, block_t: int, row0: int = 0, row1: int | None = None
) -> torch.Tensor:
    """int32 ``[5, S]`` row blocks of the rows ``[row0, row1)`` (blocks of at most ``block_t`` rows that never
    straddle a document): ``(t0, t1, document position of t0, first entry of the document, its entries)`` per slot.

    ``S = ceil((row1 - row0) / block_t) + N`` is a host capacity (each document adds at most one partial block);
    unused slots are ``(0, 0, 0, 0, 0)`` (empty: the kernel skips them). For ``row0 = 0, row1 = T`` the used slots
    equal the host plan (:func:`csa_kernels.ops.indexer.triton._row_blocks`), in the same order. Memoised on
    ``bounds``.
    """
    row1 = bounds.total if row1 is None else row1
    key = ("row_block_table", ratio, block_t, row0, row1)
    return bounds.derived(key, lambda: _row_blocks(bounds, ratio, block_t, row0, row1))


def _row_blocks(bounds: SeqBoundaries, ratio: int, block_t: int, row0: int, row1: int) -> torch.Tensor:
    cu = bounds.cu64
    cuc = bounds.compressed(ratio).cu64
    s = cu[:-1].clamp(row0, row1)  # [N] clipped document starts
    e = cu[1:].clamp(row0, row1)
    nblk = (e - s + block_t - 1) // block_t  # [N]
    blk_end = torch.cumsum(nblk, 0)  # [N]
    n_slots = -(-(row1 - row0) // block_t) + bounds.num_docs
    slot = torch.arange(n_slots, device=cu.device, dtype=torch.int64)  # [S]
    doc = torch.searchsorted(blk_end, slot, right=True)  # [S] (N on unused slots)
    used = doc < nblk.numel()
    d = doc.clamp(max=nblk.numel() - 1)
    t0 = s[d] + (slot - (blk_end[d] - nblk[d])) * block_t
    t1 = torch.minimum(t0 + block_t, e[d])
    cols = (t0, t1, t0 - cu[d], cuc[d], cuc[d + 1] - cuc[d])
    return torch.stack([torch.where(used, c, 0) for c in cols]).to(torch.int32)


def indexer_topk_device_planned(
    q_idx: torch.Tensor,  # [T, HI, DI]
    k_idx: torch.Tensor,  # [T // ratio, DI]
    weights: torch.Tensor,  # [T, HI]
    ratio: int,
    topk: int,
    bounds: SeqBoundaries,
    chunk_size: int | None = None,
    entry_tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [T, topk] int32 global entry rows, -1 padded; scores [T, topk] fp32)`` over static ``bounds``
    (module docstring); not differentiable (the caller attaches the gradient, as for the host plan)."""
    check_triton_device(q_idx, k_idx, weights)
    t, cap = bounds.total, bounds.max_entries(ratio)
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
    cuc = bounds.compressed(ratio).cu64
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
