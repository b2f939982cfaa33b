"""Inverted index and per-row gather-reduce: the deterministic, atomic-free reduction of gathered-row gradients
(sparse attention's ``dkv``, the index scores' ``dk``) whose cost is proportional to the number of (token, slot)
pairs, whatever the collisions.

Both gradients have the form ``out[r, :] = sum_{(t, j): idx[t, j] = r} c[t, j, :]``: every (token, slot) pair
``(t, j)`` contributes one row ``c[t, j, :]`` (computed token-major by the op's own kernel, which keeps its tensor-core
schedule, and stored at pair position ``p = t * K + j`` instead of being added with atomics). This module reduces
those rows per output row in a fixed order, with no atomics:

1. :func:`build_inverted_index`: the pairs' rows ``key[p]`` (``-1`` = no pair) sorted by a stable sort, so each
   output row ``r`` owns the contiguous range ``start[r] .. start[r] + count[r]`` of pair positions in ascending
   ``(t, j)`` order (``searchsorted`` of the sorted keys: offsets without a device -> host sync). Each row's list is
   cut into pieces of at most ``piece`` pairs (a hot row read by every token becomes many pieces, never one long
   program); the pieces are numbered row by row (an exclusive cumsum), and a ``searchsorted`` maps each work item of
   a grid of static size ``ceil(P / piece) + min(n_rows, P)`` (an upper bound of the piece count) to its row.
2. ``_reduce_pieces_kernel``: one program per piece sums its pairs' rows (gathered by position, ``BLOCK_P`` at a
   time, fp32) into its own partial row.
3. ``_combine_kernel``: one program per output row adds its pieces' partials in piece order (and, with
   ``accumulate``, the row's previous value first) and writes the row once.

fp32 reference (what :func:`gather_reduce` computes, up to the fixed summation order)::

    out = torch.zeros(n_rows, W, dtype=torch.float64).index_add_(0, key[key >= 0], pairs[key >= 0].double())

Work: each valid pair's row is read once (``P_valid * W`` elements), each piece's partial written and read once;
the sort is ``O(P)``. Two runs give the same bits (fixed piece boundaries, fixed in-tile reduction trees, fixed
piece order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from csa_kernels._triton_utils import interpreting, next_pow2


@dataclass(frozen=True)
class InvertedIndex:
    """Pairs grouped by output row (module docstring, step 1); all tensors on the pairs' device."""

    perm: torch.Tensor  # [P] int64: pair positions, ascending by (row, position); invalid pairs last
    start: torch.Tensor  # [n_rows] int64: first entry of row r in perm
    count: torch.Tensor  # [n_rows] int64: pairs of row r
    piece_start: torch.Tensor  # [n_rows] int64: number of the row's first piece (exclusive cumsum)
    n_pieces: torch.Tensor  # [n_rows] int64: ceil(count / piece)
    item_row: torch.Tensor  # [n_items] int64: row of work item w (n_rows = idle)
    piece: int  # pairs per piece (at most)

    @property
    def n_items(self) -> int:
        return self.item_row.shape[0]


def build_inverted_index(key: torch.Tensor, n_rows: int, piece: int) -> InvertedIndex:
    """The inverted index of ``key [P]`` (row read by pair position ``p``, ``-1`` = none; values in ``[-1,
    n_rows)``), pieces of at most ``piece`` pairs. Sync-free."""
    if piece < 1:
        raise ValueError(f"piece must be a positive int, got {piece!r}")
    dev = key.device
    P = key.shape[0]
    k = torch.where(key >= 0, key.to(torch.int32), n_rows)  # invalid pairs sort after every row
    srt, perm = torch.sort(k, stable=True)  # [P]
    bounds = torch.searchsorted(srt, torch.arange(n_rows + 1, device=dev, dtype=torch.int32))  # [n_rows + 1]
    start = bounds[:-1].contiguous()
    count = (bounds[1:] - bounds[:-1]).contiguous()
    n_pieces = torch.div(count + (piece - 1), piece, rounding_mode="floor")
    pcum = torch.cumsum(n_pieces, 0)  # inclusive
    n_items = triton.cdiv(P, piece) + min(n_rows, P)  # >= sum(ceil(count / piece))
    item_row = torch.searchsorted(pcum, torch.arange(n_items, device=dev, dtype=pcum.dtype), right=True)
    return InvertedIndex(perm, start, count, (pcum - n_pieces).contiguous(), n_pieces, item_row, piece)


@triton.jit
def _reduce_pieces_kernel(
    PAIRS,
    PERM,
    START,
    COUNT,
    PIECE_START,
    ITEM_ROW,
    PART,
    stride_pp,
    stride_part,
    n_rows,
    piece,
    WIDTH,
    BLOCK_P: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """``PART[w, cols] = sum`` of the pair rows of work item ``w``'s piece (fp32; idle items write nothing)."""
    w = tl.program_id(0).to(tl.int64)
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mw = offs_w < WIDTH
    r = tl.load(ITEM_ROW + w)
    if r < n_rows:
        j = w - tl.load(PIECE_START + r)
        first = tl.load(START + r)
        lo = first + j * piece
        hi = tl.minimum(lo + piece, first + tl.load(COUNT + r))
        acc = tl.zeros([BLOCK_W], dtype=tl.float32)
        for i0 in range(lo, hi, BLOCK_P):
            offs_p = i0 + tl.arange(0, BLOCK_P)
            mp = offs_p < hi
            pos = tl.load(PERM + offs_p, mask=mp, other=0)
            x = tl.load(
                PAIRS + pos[:, None] * stride_pp + offs_w[None, :], mask=mp[:, None] & mw[None, :], other=0.0
            )  # [BLOCK_P, BLOCK_W]
            acc += tl.sum(x.to(tl.float32), 0)
        tl.store(PART + w * stride_part + offs_w, acc, mask=mw)


@triton.jit
def _combine_kernel(
    PART,
    PIECE_START,
    N_PIECES,
    OUT,
    stride_part,
    stride_out,
    WIDTH,
    ACCUMULATE: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """``OUT[r] = (OUT[r] if ACCUMULATE else 0) + sum_i PART[piece_start[r] + i]``, pieces in order (rows
    without pieces are left alone when accumulating)."""
    r = tl.program_id(0).to(tl.int64)
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mw = offs_w < WIDTH
    n = tl.load(N_PIECES + r)
    if (n > 0) or (not ACCUMULATE):  # accumulating a row without pairs: nothing to read or write
        if ACCUMULATE:
            acc = tl.load(OUT + r * stride_out + offs_w, mask=mw, other=0.0)
        else:
            acc = tl.zeros([BLOCK_W], dtype=tl.float32)
        p0 = tl.load(PIECE_START + r)
        for i in range(0, n):
            acc += tl.load(PART + (p0 + i) * stride_part + offs_w, mask=mw, other=0.0)
        tl.store(OUT + r * stride_out + offs_w, acc, mask=mw)


def _tiles(width: int) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_W, num_warps) of the reduce: ``[BLOCK_P, BLOCK_W]`` gathered tiles, 32 elements per thread
    (8 rows of 2 KiB in flight per program at W = 512)."""
    block_w = min(next_pow2(width), 512)
    if interpreting():
        return 4, block_w, 1
    warps = max(1, min(4, block_w // 128))
    return max(1, (32 * 32 * warps) // block_w), block_w, warps


def gather_reduce(
    pairs: torch.Tensor,  # [P, W] pair rows (fp32 or bf16), row p = the contribution of pair position p
    index: InvertedIndex,
    out: torch.Tensor,  # [n_rows, W] fp32, contiguous
    accumulate: bool,
) -> torch.Tensor:
    """``out[r] (+)= sum`` of the pair rows of ``r`` in the index's fixed order (module docstring); returns ``out``.

    Only the rows of valid pairs are read: the others may hold anything (uninitialised memory included)."""
    n_rows, width = out.shape
    if n_rows == 0 or width == 0:
        return out
    block_p, block_w, warps = _tiles(width)
    n_col = triton.cdiv(width, block_w)
    part = torch.empty((max(index.n_items, 1), width), dtype=torch.float32, device=out.device)
    if index.n_items:
        _reduce_pieces_kernel[(index.n_items, n_col)](
            pairs,
            index.perm,
            index.start,
            index.count,
            index.piece_start,
            index.item_row,
            part,
            pairs.stride(0),
            part.stride(0),
            n_rows,
            index.piece,
            width,
            BLOCK_P=block_p,
            BLOCK_W=block_w,
            num_warps=warps,
        )
    _combine_kernel[(n_rows, n_col)](
        part,
        index.piece_start,
        index.n_pieces,
        out,
        part.stride(0),
        out.stride(0),
        width,
        ACCUMULATE=accumulate,
        BLOCK_W=block_w,
        num_warps=max(1, min(4, block_w // 128)),
    )
    return out
