"""Inverted index and per-row gather-reduce: the deterministic, atomic-free reduction of gathered-row gradients
(sparse attention's ``dkv``, the index scores' ``dk``) whose cost is proportional to the number of (token, slot)
pairs, whatever the collisions.

Both gradients have the form ``out[r, :] = sum_{(t, j): idx[t, j] = r} c[t, j, :]``: every (token, slot) pair
``(t, j)`` contributes one row ``c[t, j, :]`` (computed token-major by the op's own kernel, which keeps its tensor-core
schedule, and stored at pair position ``p = t * K + j`` instead of being added with atomics). This module reduces
those rows per output row in a fixed order, with no atomics:

1. :func:`sort_pairs` (once per backward): the pairs' rows ``key[p]`` (``-1`` = no pair) sorted by a stable sort,
   so each output row ``r`` owns a contiguous list of pair positions in ascending ``(t, j)`` order; the sorted
   composite ``key * P + p`` lets :func:`chunk_index` find, for any range of positions (a chunk of tokens), each
   row's sub-list by two ``searchsorted`` (no device -> host sync). Each row's list is cut into pieces of at most
   ``piece`` pairs (a hot row read by every token becomes many pieces, never one long program); the pieces are
   numbered row by row (an exclusive cumsum), and a ``searchsorted`` maps each work item of a grid of static size
   ``ceil(P_chunk / piece) + min(n_rows, P_chunk)`` (an upper bound of the piece count) to its row.
2. ``_reduce_pieces_kernel``: one program per piece sums its pairs' rows (gathered by position, ``BLOCK_P`` at a
   time, fp32; a pair may have one row per head block, summed in block order) into its own partial row.
3. ``_combine_kernel``: one program per output row adds its pieces' partials in piece order (and, with
   ``accumulate``, the row's previous value first) and writes the row once.

fp32 reference (what :func:`gather_reduce` computes, up to the fixed summation order)::

    v = key >= 0   # pairs [B, P, W]: B rows per pair (head blocks)
    out = torch.zeros(n_rows, W, dtype=torch.float64).index_add_(0, key[v], pairs[:, v].double().sum(0))

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
class SortedPairs:
    """Pair positions sorted by (row, position) (module docstring, step 1)."""

    perm: torch.Tensor  # [P] int64: pair positions, ascending by (row, position); invalid pairs last
    composite: (
        torch.Tensor
    )  # [P] int64: row * P + position of perm's entries (ascending; row n_rows = invalid)
    n_rows: int


@dataclass(frozen=True)
class InvertedIndex:
    """The pairs with positions in ``[pos0, pos0 + n_pos)`` grouped by output row; all tensors on the pairs' device."""

    perm: torch.Tensor  # [P] int64: SortedPairs.perm
    start: torch.Tensor  # [n_rows] int64: first entry of row r's sub-list in perm
    count: torch.Tensor  # [n_rows] int64: pairs of row r in the range
    piece_start: torch.Tensor  # [n_rows] int64: number of the row's first piece (exclusive cumsum)
    n_pieces: torch.Tensor  # [n_rows] int64: ceil(count / piece)
    item_row: torch.Tensor  # [n_items] int64: row of work item w (n_rows = idle)
    piece: int  # pairs per piece (at most)
    pos0: int  # first position of the range: pair p is row p - pos0 of the pair buffer

    @property
    def n_items(self) -> int:
        return self.item_row.shape[0]


def sort_pairs(key: torch.Tensor, n_rows: int) -> SortedPairs:
    """Sort the pairs of ``key [P]`` (row read by pair position ``p``, ``-1`` = none; values in ``[-1, n_rows)``)
    by (row, position): one stable integer sort. Sync-free."""
    P = key.shape[0]
    k = torch.where(key >= 0, key.to(torch.int32), n_rows)  # invalid pairs sort after every row
    srt, perm = torch.sort(k, stable=True)  # [P]; equal rows keep ascending positions
    return SortedPairs(perm, srt.to(torch.int64) * max(P, 1) + perm, n_rows)


def chunk_index(sp: SortedPairs, pos0: int, pos1: int, piece: int) -> InvertedIndex:
    """The inverted index of the pairs with positions in ``[pos0, pos1)``, pieces of at most ``piece`` pairs."""
    if piece < 1:
        raise ValueError(f"piece must be a positive int, got {piece!r}")
    dev = sp.perm.device
    P = max(sp.perm.shape[0], 1)
    rows = torch.arange(sp.n_rows, device=dev, dtype=torch.int64) * P
    start = torch.searchsorted(sp.composite, rows + pos0)  # [n_rows]
    count = torch.searchsorted(sp.composite, rows + pos1) - start
    n_pieces = torch.div(count + (piece - 1), piece, rounding_mode="floor")
    pcum = torch.cumsum(n_pieces, 0)  # inclusive
    n_pos = max(pos1 - pos0, 0)
    n_items = triton.cdiv(n_pos, piece) + min(sp.n_rows, n_pos)  # >= sum(ceil(count / piece))
    item_row = torch.searchsorted(pcum, torch.arange(n_items, device=dev, dtype=pcum.dtype), right=True)
    return InvertedIndex(
        sp.perm, start, count, (pcum - n_pieces).contiguous(), n_pieces, item_row, piece, pos0
    )


def build_inverted_index(key: torch.Tensor, n_rows: int, piece: int) -> InvertedIndex:
    """The inverted index of all pairs of ``key [P]`` (:func:`sort_pairs` + :func:`chunk_index`)."""
    return chunk_index(sort_pairs(key, n_rows), 0, key.shape[0], piece)


@triton.jit
def _reduce_pieces_kernel(
    PAIRS,
    PERM,
    START,
    COUNT,
    PIECE_START,
    ITEM_ROW,
    PART,
    stride_pb,
    stride_pp,
    stride_part,
    n_rows,
    piece,
    pos0,
    WIDTH,
    N_BLOCKS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """``PART[w, cols] = sum`` of the pair rows (all ``N_BLOCKS`` of each pair) of work item ``w``'s piece (fp32;
    idle items write nothing)."""
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
            pos = tl.load(PERM + offs_p, mask=mp, other=pos0) - pos0
            for b in tl.static_range(N_BLOCKS):
                x = tl.load(
                    PAIRS + b * stride_pb + pos[:, None] * stride_pp + offs_w[None, :],
                    mask=mp[:, None] & mw[None, :],
                    other=0.0,
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
    p0 = tl.load(PIECE_START + r)
    if ACCUMULATE:
        if n > 0:  # a row without pairs in this range: nothing to read or write
            acc = tl.load(OUT + r * stride_out + offs_w, mask=mw, other=0.0)
            acc = _add_pieces(PART, p0, n, acc, stride_part, offs_w, mw)
            tl.store(OUT + r * stride_out + offs_w, acc, mask=mw)
    else:
        acc = _add_pieces(PART, p0, n, tl.zeros([BLOCK_W], dtype=tl.float32), stride_part, offs_w, mw)
        tl.store(OUT + r * stride_out + offs_w, acc, mask=mw)


@triton.jit
def _add_pieces(PART, p0, n, acc, stride_part, offs_w, mw):
    """``acc + PART[p0] + ... + PART[p0 + n - 1]`` (columns ``offs_w``), in piece order."""
    for i in range(0, n):
        acc += tl.load(PART + (p0 + i) * stride_part + offs_w, mask=mw, other=0.0)
    return acc


def _tiles(width: int) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_W, num_warps) of the reduce: ``[BLOCK_P, BLOCK_W]`` gathered tiles, 32 elements per thread
    (8 rows of 2 KiB in flight per program at W = 512)."""
    block_w = min(next_pow2(width), 512)
    if interpreting():
        return 4, block_w, 1
    warps = max(1, min(4, block_w // 128))
    return max(1, (32 * 32 * warps) // block_w), block_w, warps


def gather_reduce(
    pairs: torch.Tensor,  # [B, n_pos, W] (or [n_pos, W]) pair rows, fp32 or bf16: row p - pos0 = pair p's
    index: InvertedIndex,
    out: torch.Tensor,  # [n_rows, W] fp32, contiguous
    accumulate: bool,
) -> torch.Tensor:
    """``out[r] (+)= sum`` of the pair rows of ``r`` in the index's fixed order (module docstring); returns ``out``.

    Only the rows of the index's pairs are read: the others may hold anything (uninitialised memory included)."""
    if pairs.dim() == 2:
        pairs = pairs.unsqueeze(0)
    n_rows, width = out.shape
    if n_rows == 0 or width == 0:
        return out
    if pairs.stride(-1) != 1:
        raise ValueError("gather_reduce: the pair rows need a unit last stride")
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
            pairs.stride(1),
            part.stride(0),
            n_rows,
            index.piece,
            index.pos0,
            width,
            N_BLOCKS=pairs.shape[0],
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
