"""Atomic-free, bitwise-reproducible ``dkv`` of the sparse attention: a key-major pass over a transposed index.

Math (``ds = p (dp - delta)``, ``m[t, r]`` = how many slots of token ``t`` hold row ``r``; repeated slots count)::

    dkv[r, :] = sum_t m[t, r] * sum_h ( scale * ds[t,h,r] * q[t,h,:] + p[t,h,r] * do[t,h,:] )

Schedule. The rows of ``kv`` are cut into blocks of ``BLOCK_R`` rows. The transposed index is built on the device,
deterministically and without a device -> host sync:

1. each token's valid slots are sorted (ascending rows, an integer sort);
2. ``_segments_kernel`` (one program per token) writes, for every row block the token touches, where its slots of
   that block start and end in the sorted row (``SEG_START / SEG_END [n_blocks, T]``; ``SEG_END = 0`` = untouched);
3. an integer prefix sum over the touched flags gives every (block, token) pair its place in a block-major,
   token-ascending list ``TOK`` (``_list_kernel``), so each block knows the tokens that read it.

``_dkv_keymajor_kernel`` runs one program per (row block, split): the block's ``[BLOCK_R, D]`` rows stay resident,
the program walks its share of the block's token list and per token (and head block) does four MMAs:
``sT = kv_b qᵀ``, ``dpT = kv_b doᵀ`` (``[BLOCK_R, BLOCK_H]``), then ``acc += (scale dsT) q + pT do``
(``[BLOCK_R, D]`` fp32 in registers), with ``m[t, r]`` (counted from the token's
segment) multiplying ``pT``; rows the token does not read get ``m = 0``. Each split writes its own fp32 partial
``[n_split, rows, D]``; the splits are summed in a fixed order (``torch.sum`` over the split axis). No atomics, no
order that depends on scheduling: two runs give the same bits. The splits exist for load balance (a compressed entry
picked by thousands of tokens would otherwise be one long program); their count is chosen on the host from the
shapes so that the partials stay below ``PARTIAL_BYTES``.

Work: ``4 * 2 * BLOCK_R * H * D`` flops per touched (block, token) pair: when a token reads most rows of the blocks
it touches (the window band, top-k over a short causal prefix) this is the useful work of the atomic kernel; a
scattered selection over many entries wastes the untouched rows of each block.
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
def _dkv_keymajor_kernel(
    Q,
    KV,
    DO,
    LSE,
    DELTA,
    SIDX,
    SEG_START,
    SEG_END,
    TOK,
    NTOK,
    TOK_OFF,
    PART,
    stride_qt,
    stride_qh,
    stride_kvn,
    stride_dot,
    stride_doh,
    stride_it,
    stride_ps,
    stride_pn,
    T,
    H,
    NKV,
    n_split,
    scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    sp = tl.program_id(1)
    n_b = tl.load(NTOK + b)
    part = tl.cdiv(n_b, n_split)
    i0 = sp * part
    i1 = tl.minimum(i0 + part, n_b)
    if i0 < i1:
        off = tl.load(TOK_OFF + b)
        rows = b * BLOCK_R + tl.arange(0, BLOCK_R)
        mr = rows < NKV
        offs_d = tl.arange(0, BLOCK_D)
        md = offs_d < D
        kvb = tl.load(
            KV + rows.to(tl.int64)[:, None] * stride_kvn + offs_d[None, :],
            mask=mr[:, None] & md[None, :],
            other=0.0,
        )  # [BLOCK_R, BLOCK_D]
        if UPCAST:
            kvb = kvb.to(tl.float32)
        qk_scale_log2 = scale * 1.4426950408889634
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for i in range(i0, i1):
            t = tl.load(TOK + off + i).to(tl.int64)
            st = tl.load(SEG_START + b.to(tl.int64) * T + t)
            en = tl.load(SEG_END + b.to(tl.int64) * T + t)
            mult = tl.zeros([BLOCK_R], dtype=tl.int32)
            for k0 in range(st, en, BLOCK_S):
                offs_s = k0 + tl.arange(0, BLOCK_S)
                ids = tl.load(SIDX + t * stride_it + offs_s, mask=offs_s < en, other=-1)
                mult += tl.sum((ids[:, None] == rows[None, :]).to(tl.int32), 0)
            multf = mult.to(tl.float32)
            for h0 in range(0, H, BLOCK_H):
                offs_h = h0 + tl.arange(0, BLOCK_H)
                mh = offs_h < H
                mhd = mh[:, None] & md[None, :]
                q = tl.load(
                    Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :], mask=mhd, other=0.0
                )
                do = tl.load(
                    DO + t * stride_dot + offs_h[:, None] * stride_doh + offs_d[None, :], mask=mhd, other=0.0
                )
                if UPCAST:
                    q = q.to(tl.float32)
                    do = do.to(tl.float32)
                lse2 = tl.load(LSE + t * H + offs_h, mask=mh, other=0.0) * 1.4426950408889634
                delta = tl.load(DELTA + t * H + offs_h, mask=mh, other=0.0)
                s_t = (
                    tl.dot(kvb, tl.trans(q), input_precision=PRECISION) * qk_scale_log2
                )  # [BLOCK_R, BLOCK_H]
                live = (mult[:, None] > 0) & mh[None, :]
                p_t = tl.where(live, tl.exp2(s_t - lse2[None, :]), 0.0) * multf[:, None]
                dp_t = tl.dot(kvb, tl.trans(do), input_precision=PRECISION)
                ds_t = p_t * (dp_t - delta[None, :]) * scale
                if UPCAST:
                    acc = tl.dot(p_t, do, acc, input_precision=PRECISION)
                    acc = tl.dot(ds_t, q, acc, input_precision=PRECISION)
                else:
                    acc = tl.dot(p_t.to(KV.dtype.element_ty), do, acc, input_precision=PRECISION)
                    acc = tl.dot(ds_t.to(KV.dtype.element_ty), q, acc, input_precision=PRECISION)
        tl.store(
            PART + sp.to(tl.int64) * stride_ps + rows.to(tl.int64)[:, None] * stride_pn + offs_d[None, :],
            acc,
            mask=mr[:, None] & md[None, :],
        )


# Benchmarks may pin (BLOCK_R, BLOCK_H, num_warps, num_stages) here; None = the default below.
KEYMAJOR_CONFIG_OVERRIDE: tuple[int, int, int, int] | None = None


def _config(H: int, fp32: bool) -> tuple[int, int, int, int]:
    if interpreting():
        return 16, min(next_pow2(H), 64), 4, 1
    if KEYMAJOR_CONFIG_OVERRIDE is not None:
        return KEYMAJOR_CONFIG_OVERRIDE
    block_h = 64 if H >= 64 else max(16, next_pow2(H))
    if fp32:  # exact fp32 dots: [32, 512] fp32 kv block + q / do tiles
        return 32, min(block_h, 32), 8, 1
    # H200 sweeps at V4-Flash S=4096 (fwd+bwd ms; atomic path 7.8): (32, 64, 8, 1) 10.0; (32, 64, 4, 1) 13.2-13.4;
    # (32, 64, 8, 2) 13.2; (16, 64, 4, 1) 14.9; (64, 32, 4, 1) 19.0; (64, 64, 8, 1) 45.8 (spills); (32, 64, 4, 2)
    # 130; (64, 64, 8, 2) needs 325 KiB of shared memory
    return 32, block_h, 8, 1


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


def dkv_keymajor(
    q: torch.Tensor,  # [T, H, D]
    kv: torch.Tensor,  # [Nkv, D]
    do: torch.Tensor,  # [T, H, D]
    lse: torch.Tensor,  # [T, H] fp32
    delta: torch.Tensor,  # [T, H] fp32
    indices: torch.Tensor,  # [T, K] int32 (compacted: valid first, -1 after)
    counts: torch.Tensor,  # [T] int32
    softmax_scale: float,
    precision: str,
) -> torch.Tensor:
    """``dkv [Nkv, D]`` fp32, bitwise reproducible (module docstring)."""
    T, H, D = q.shape
    n_rows = kv.shape[0]
    block_r, block_h, warps, stages = _config(H, q.element_size() >= 4 and D > 256)
    nb = triton.cdiv(max(n_rows, 1), block_r)
    sidx, _, _ = sort_rows(indices)
    seg_start, seg_end, tok, ntok, tok_off = transposed_index(sidx, counts, n_rows, block_r)
    n_split = n_splits(nb, block_r, D)
    part = torch.zeros((n_split, nb * block_r, D), dtype=torch.float32, device=kv.device)
    _dkv_keymajor_kernel[(nb, n_split)](
        q,
        kv,
        do,
        lse,
        delta,
        sidx,
        seg_start,
        seg_end,
        tok,
        ntok,
        tok_off,
        part,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        do.stride(0),
        do.stride(1),
        sidx.stride(0),
        part.stride(0),
        part.stride(1),
        T,
        H,
        n_rows,
        n_split,
        softmax_scale,
        D=D,
        BLOCK_D=next_pow2(D),
        BLOCK_H=block_h,
        BLOCK_R=block_r,
        BLOCK_S=16 if interpreting() else 64,
        UPCAST=interpreting(),
        PRECISION=precision,
        num_warps=warps,
        num_stages=stages,
    )
    return part.sum(0)[:n_rows]
