"""Atomic-free, bitwise-reproducible ``dkv`` of the sparse attention: a key-major pass over a transposed index.

Math (``ds = p (dp - delta)``, ``m[t, r]`` = how many slots of token ``t`` hold row ``r``; repeated slots count)::

    dkv[r, :] = sum_t m[t, r] * sum_h ( scale * ds[t,h,r] * q[t,h,:] + p[t,h,r] * do[t,h,:] )

Schedule: the key-major pass of :mod:`csa_kernels._keymajor` (transposed index, one program per (row block,
split), fixed-order sum of the splits' fp32 partials; two runs give the same bits). Per token of its block's list
(and head block) ``_dkv_keymajor_kernel`` does four MMAs: ``sT = kv_b qᵀ``, ``dpT = kv_b doᵀ`` (``[BLOCK_R,
BLOCK_H]``), then ``acc += (scale dsT) q + pT do`` (``[BLOCK_R, D]`` fp32 in registers), with ``m[t, r]`` (counted
from the token's segment) multiplying ``pT``; rows the token does not read get ``m = 0``.

Work: ``4 * 2 * BLOCK_R * H * D`` flops per touched (block, token) pair: when a token reads most rows of the blocks
it touches (the window band, top-k over a short causal prefix) this is the useful work of the atomic kernel; a
scattered selection over many entries wastes the untouched rows of each block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from csa_kernels._keymajor import (
    keymajor_sum,
    load_row_block,
    sort_rows,
    store_partial,
    token_range,
    token_segment,
)
from csa_kernels._triton_utils import interpreting, next_pow2


@triton.jit
def _dkv_keymajor_kernel(
    SIDX,
    SEG_START,
    SEG_END,
    TOK,
    NTOK,
    TOK_OFF,
    PART,
    stride_it,
    stride_ps,
    stride_pn,
    T,
    NKV,
    n_split,
    Q,
    KV,
    DO,
    LSE,
    DELTA,
    stride_qt,
    stride_qh,
    stride_kvn,
    stride_dot,
    stride_doh,
    H,
    scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b, sp, i0, i1 = token_range(NTOK, n_split)
    if i0 < i1:
        off = tl.load(TOK_OFF + b)
        rows, mr, offs_d, md, kvb = load_row_block(
            KV, b, stride_kvn, NKV, D, BLOCK_R, BLOCK_D, UPCAST
        )  # kvb [BLOCK_R, BLOCK_D]
        qk_scale_log2 = scale * 1.4426950408889634
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for i in range(i0, i1):
            t, st, en = token_segment(TOK, SEG_START, SEG_END, off, i, b, T)
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
        store_partial(PART, sp, rows, mr, offs_d, md, acc, stride_ps, stride_pn)


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
    _, H, D = q.shape
    n_rows = kv.shape[0]
    block_r, block_h, warps, stages = _config(H, q.element_size() >= 4 and D > 256)
    sidx, _, _ = sort_rows(indices)
    return keymajor_sum(
        _dkv_keymajor_kernel,
        sidx,
        counts,
        n_rows,
        D,
        block_r,
        q,
        kv,
        do,
        lse,
        delta,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        do.stride(0),
        do.stride(1),
        H,
        softmax_scale,
        D=D,
        BLOCK_D=next_pow2(D),
        BLOCK_H=block_h,
        PRECISION=precision,
        num_warps=warps,
        num_stages=stages,
    )
