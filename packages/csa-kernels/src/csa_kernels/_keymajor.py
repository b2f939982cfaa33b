"""The key-major backward schedule shared by the deterministic (atomic-free, bitwise-reproducible) gradients of the
gathered rows: sparse attention's ``dkv`` (:mod:`csa_kernels.ops.sparse_attn.dkv_keymajor`) and the index scores'
``dk`` (:mod:`csa_kernels.ops.indexer.scores_at_keymajor`).

Both gradients have the form ``d[r, :] = sum_t sum_{slots j of t holding r} f(t, j, r)``: a row gets one term from
every token that selected it. Instead of scattering these terms with atomics, the rows are cut into blocks of
``BLOCK_R`` rows and a transposed index lists, per block, the tokens that read it. It is built on the device,
deterministically and without a device -> host sync:

1. :func:`sort_rows`: each token's valid slots sorted (ascending rows, a stable integer sort);
2. ``_segments_kernel`` (one program per token) writes, for every row block the token touches, where its slots of
   that block start and end in the sorted row (``SEG_START / SEG_END [n_blocks, T]``; ``SEG_END = 0`` = untouched);
3. an integer prefix sum over the touched flags gives every (block, token) pair its place in a block-major,
   token-ascending list ``TOK`` (``_list_kernel``), so each block knows the tokens that read it.

An op's kernel (launched by :func:`keymajor_sum`) runs one program per (row block, split): the block's rows stay
resident (:func:`load_row_block`), the program walks its share of the block's token list (:func:`token_range`,
:func:`token_segment`), accumulates in fp32 registers and writes its own fp32 partial ``[n_split, rows, width]``
(:func:`store_partial`); the splits are summed in a fixed order (``torch.sum`` over the split axis). No atomics, no
order that depends on scheduling: two runs give the same bits. The splits exist for load balance (a row picked by
thousands of tokens would otherwise be one long program); their count is chosen on the host from the shapes so that
the partials stay below ``PARTIAL_BYTES``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from csa_kernels._triton_utils import interpreting, next_pow2

PARTIAL_BYTES = 768 << 20  # cap of the fp32 split partials
MAX_SPLIT = 16


@triton.jit
def _segments_kernel(
    SIDX, CNT, SEG_START, SEG_END, T, stride_it, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr
):
    """Token ``t``'s sorted valid rows -> ``[start, end)`` of each touched row block in that sorted row."""
    t = tl.program_id(0)
    cnt = tl.load(CNT + t)
    for k0 in range(0, cnt, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        m = offs < cnt
        row = tl.load(SIDX + t.to(tl.int64) * stride_it + offs, mask=m, other=0)
        blk = row // BLOCK_R
        prev = tl.load(SIDX + t.to(tl.int64) * stride_it + offs - 1, mask=m & (offs > 0), other=-1)
        nxt = tl.load(SIDX + t.to(tl.int64) * stride_it + offs + 1, mask=m & (offs + 1 < cnt), other=-1)
        first = m & ((offs == 0) | (prev < 0) | (prev // BLOCK_R != blk))
        last = m & ((offs + 1 == cnt) | (nxt // BLOCK_R != blk))
        slot = blk.to(tl.int64) * T + t
        tl.store(SEG_START + slot, offs, mask=first)
        tl.store(SEG_END + slot, offs + 1, mask=last)


@triton.jit
def _list_kernel(SEG_END, POS, TOK, total, T, BLOCK: tl.constexpr):
    """``TOK[POS[i] - 1] = i % T`` for every touched (block, token) cell ``i`` of the block-major grid."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < total
    touched = tl.load(SEG_END + offs, mask=m, other=0) > 0
    pos = tl.load(POS + offs, mask=m, other=1)
    tl.store(TOK + pos - 1, (offs % T).to(tl.int32), mask=m & touched)


@triton.jit
def token_range(NTOK, n_split):
    """This program's row block ``b``, split ``sp`` and its share ``[i0, i1)`` of the block's token list."""
    b = tl.program_id(0)
    sp = tl.program_id(1)
    n_b = tl.load(NTOK + b)
    part = tl.cdiv(n_b, n_split)
    i0 = sp * part
    i1 = tl.minimum(i0 + part, n_b)
    return b, sp, i0, i1


@triton.jit
def load_row_block(
    X, b, stride_xn, N, WIDTH, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, UPCAST: tl.constexpr
):
    """Rows ``b * BLOCK_R + [0, BLOCK_R)`` of ``X [N, WIDTH]``: ``(rows, row mask, columns, column mask, block)``,
    the block ``[BLOCK_R, BLOCK_W]`` zero-padded (fp32 under ``UPCAST``)."""
    rows = b * BLOCK_R + tl.arange(0, BLOCK_R)
    mr = rows < N
    offs_w = tl.arange(0, BLOCK_W)
    mw = offs_w < WIDTH
    xb = tl.load(
        X + rows.to(tl.int64)[:, None] * stride_xn + offs_w[None, :],
        mask=mr[:, None] & mw[None, :],
        other=0.0,
    )  # [BLOCK_R, BLOCK_W]
    if UPCAST:
        xb = xb.to(tl.float32)
    return rows, mr, offs_w, mw, xb


@triton.jit
def token_segment(TOK, SEG_START, SEG_END, off, i, b, T):
    """The ``i``-th token ``t`` of block ``b``'s list (which starts at ``off``) and ``[st, en)``, its slots of the
    block in its sorted row."""
    t = tl.load(TOK + off + i).to(tl.int64)
    st = tl.load(SEG_START + b.to(tl.int64) * T + t)
    en = tl.load(SEG_END + b.to(tl.int64) * T + t)
    return t, st, en


@triton.jit
def store_partial(PART, sp, rows, mr, offs_w, mw, acc, stride_ps, stride_pn):
    """Write the fp32 ``acc [BLOCK_R, BLOCK_W]`` of rows ``rows`` into split ``sp``'s partial."""
    tl.store(
        PART + sp.to(tl.int64) * stride_ps + rows.to(tl.int64)[:, None] * stride_pn + offs_w[None, :],
        acc,
        mask=mr[:, None] & mw[None, :],
    )


def sort_rows(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's valid entries first, ascending (a stable integer sort: equal rows keep their slot order);
    returns ``(sorted [T, K] int32 with INT32_MAX after the valid ones, order [T, K] int64, counts [T] int32)``."""
    big = torch.iinfo(torch.int32).max
    valid = indices >= 0
    srt = torch.where(valid, indices.to(torch.int32), big).sort(dim=1, stable=True)
    return srt.values.contiguous(), srt.indices, valid.sum(1, dtype=torch.int32)


def transposed_index(sidx: torch.Tensor, counts: torch.Tensor, n_rows: int, block_r: int):
    """Device-built, deterministic transposed index (module docstring, steps 2-3) of the row-sorted index ``sidx``
    (:func:`sort_rows`). Returns ``(seg_start, seg_end [n_blocks, T], tok [n_blocks * T], ntok, tok_off)``."""
    T, K = sidx.shape
    nb = triton.cdiv(max(n_rows, 1), block_r)
    seg_start = torch.zeros((nb, T), dtype=torch.int32, device=sidx.device)
    seg_end = torch.zeros((nb, T), dtype=torch.int32, device=sidx.device)
    if K > 0:
        _segments_kernel[(T,)](
            sidx,
            counts,
            seg_start,
            seg_end,
            T,
            sidx.stride(0),
            BLOCK_R=block_r,
            BLOCK_K=min(next_pow2(K), 1024),
        )
    touched = (seg_end > 0).view(-1)
    pos = torch.cumsum(touched, 0, dtype=torch.int32)  # [nb * T], inclusive
    ntok = (seg_end > 0).sum(1, dtype=torch.int32)  # [nb]
    tok_off = (torch.cumsum(ntok, 0, dtype=torch.int32) - ntok).contiguous()
    tok = torch.empty(nb * T, dtype=torch.int32, device=sidx.device)
    total = nb * T
    blk = 1024
    _list_kernel[(triton.cdiv(total, blk),)](seg_end, pos, tok, total, T, BLOCK=blk)
    return seg_start, seg_end, tok, ntok, tok_off


def n_splits(n_blocks: int, block_r: int, width: int) -> int:
    """Token-list splits per row block: as many as keep the fp32 partials ``[splits, rows, width]`` under
    ``PARTIAL_BYTES`` (at most ``MAX_SPLIT``; 2 in the interpreter, to exercise the fixed-order sum)."""
    if interpreting():
        return 2
    return max(1, min(MAX_SPLIT, PARTIAL_BYTES // max(1, n_blocks * block_r * width * 4)))


def keymajor_sum(
    kernel,
    sidx: torch.Tensor,  # [T, K] int32, rows sorted (sort_rows)
    counts: torch.Tensor,  # [T] int32 valid slots per row
    n_rows: int,
    width: int,
    block_r: int,
    *op_args,
    num_warps: int,
    num_stages: int,
    **meta,
) -> torch.Tensor:
    """``[n_rows, width]`` fp32: builds the transposed index of ``sidx``, launches the op's ``kernel`` over (row
    block, split) and sums the splits' partials in a fixed order.

    ``kernel`` takes the schedule's arguments first, ``(SIDX, SEG_START, SEG_END, TOK, NTOK, TOK_OFF, PART,
    stride_it, stride_ps, stride_pn, T, N, n_split)``, then ``op_args``, and the constexprs ``BLOCK_R``,
    ``BLOCK_S`` (slots read per step of a token's segment), ``UPCAST`` (interpreter: fp32 operands) and ``meta``.
    """
    nb = triton.cdiv(max(n_rows, 1), block_r)
    seg_start, seg_end, tok, ntok, tok_off = transposed_index(sidx, counts, n_rows, block_r)
    n_split = n_splits(nb, block_r, width)
    part = torch.zeros((n_split, nb * block_r, width), dtype=torch.float32, device=sidx.device)
    kernel[(nb, n_split)](
        sidx,
        seg_start,
        seg_end,
        tok,
        ntok,
        tok_off,
        part,
        sidx.stride(0),
        part.stride(0),
        part.stride(1),
        sidx.shape[0],
        n_rows,
        n_split,
        *op_args,
        BLOCK_R=block_r,
        BLOCK_S=16 if interpreting() else 64,
        UPCAST=interpreting(),
        num_warps=num_warps,
        num_stages=num_stages,
        **meta,
    )
    return part.sum(0)[:n_rows]
