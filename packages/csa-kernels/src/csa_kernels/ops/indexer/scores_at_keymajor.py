"""Atomic-free, bitwise-reproducible ``dk`` of the index scores at given entries (key-major pass).

Math (``g[t, j]`` the upstream gradient of slot ``j``, ``G[t, e] = sum_{j: idx[t,j] = e} g[t, j]``)::

    dk[e, :] = sum_t sum_h G[t, e] * w[t, h] * [<q[t,h], k[e]> > 0] * q[t, h, :]

Schedule: the key-major pass of :mod:`csa_kernels._keymajor` (each row's valid entries sorted by a stable integer
sort, ``g`` gathered in the same order; one program per (entry block, split), fixed-order sum of the splits' fp32
partials). ``_dk_keymajor_kernel`` keeps the ``[BLOCK_R, DI]`` key block resident and walks its tokens: ``G`` of
the block's rows from the token's segment (fp32, slot order), then per head block ``sT = k_b qᵀ``
(``[BLOCK_R, BLOCK_H]``) and ``acc += dsT q`` (``[BLOCK_R, DI]`` fp32). Two runs give the same bits.
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
def _dk_keymajor_kernel(
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
    NK,
    n_split,
    Q,
    K,
    W,
    SG,
    stride_qt,
    stride_qh,
    stride_kc,
    stride_wt,
    HI,
    DI: tl.constexpr,
    BLOCK_DI: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b, sp, i0, i1 = token_range(NTOK, n_split)
    if i0 < i1:
        off = tl.load(TOK_OFF + b)
        rows, mr, offs_d, md, kb = load_row_block(
            K, b, stride_kc, NK, DI, BLOCK_R, BLOCK_DI, UPCAST
        )  # kb [BLOCK_R, BLOCK_DI]
        acc = tl.zeros([BLOCK_R, BLOCK_DI], dtype=tl.float32)
        for i in range(i0, i1):
            t, st, en = token_segment(TOK, SEG_START, SEG_END, off, i, b, T)
            gr = tl.zeros([BLOCK_R], dtype=tl.float32)
            for k0 in range(st, en, BLOCK_S):
                offs_s = k0 + tl.arange(0, BLOCK_S)
                ms = offs_s < en
                ids = tl.load(SIDX + t * stride_it + offs_s, mask=ms, other=-1)
                gv = tl.load(SG + t * stride_it + offs_s, mask=ms, other=0.0)
                gr += tl.sum(tl.where(ids[:, None] == rows[None, :], gv[:, None], 0.0), 0)
            for h0 in range(0, HI, BLOCK_H):
                offs_h = h0 + tl.arange(0, BLOCK_H)
                mh = offs_h < HI
                q = tl.load(
                    Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                    mask=mh[:, None] & md[None, :],
                    other=0.0,
                )  # [BLOCK_H, BLOCK_DI]
                if UPCAST:
                    q = q.to(tl.float32)
                w = tl.load(W + t * stride_wt + offs_h, mask=mh, other=0.0).to(tl.float32)
                s_t = tl.dot(kb, tl.trans(q), input_precision=PRECISION)  # [BLOCK_R, BLOCK_H]
                ds_t = tl.where(s_t > 0.0, gr[:, None] * w[None, :], 0.0)
                if UPCAST:
                    acc = tl.dot(ds_t, q, acc, input_precision=PRECISION)
                else:
                    acc = tl.dot(ds_t.to(K.dtype.element_ty), q, acc, input_precision=PRECISION)
        store_partial(PART, sp, rows, mr, offs_d, md, acc, stride_ps, stride_pn)


def _config(HI: int, DI: int, fp32: bool) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_H, num_warps, num_stages)."""
    block_h = min(64, max(16, next_pow2(HI)))
    if interpreting():
        return 16, block_h, 4, 1
    if fp32:
        return 32, min(block_h, 32), 4, 1
    return 64, block_h, 8 if next_pow2(DI) >= 256 else 4, 1


def scores_at_dk_keymajor(
    q: torch.Tensor,  # [T, HI, DI] (kernel operand dtype, unit last stride)
    k: torch.Tensor,  # [Tc, DI]
    w: torch.Tensor,  # [T, HI]
    indices: torch.Tensor,  # [T, K], -1 = empty
    grad: torch.Tensor,  # [T, K] fp32 (ignored at -1)
    precision: str,
) -> torch.Tensor:
    """``dk [Tc, DI]`` fp32, bitwise reproducible (module docstring)."""
    _, HI, DI = q.shape
    block_r, block_h, warps, stages = _config(HI, DI, q.dtype == torch.float32)
    sidx, order, counts = sort_rows(indices)
    sg = torch.where(indices >= 0, grad.float(), 0.0).gather(1, order).contiguous()  # g in sorted slot order
    return keymajor_sum(
        _dk_keymajor_kernel,
        sidx,
        counts,
        k.shape[0],
        DI,
        block_r,
        q,
        k,
        w,
        sg,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        w.stride(0),
        HI,
        DI=DI,
        BLOCK_DI=max(16, next_pow2(DI)),
        BLOCK_H=block_h,
        PRECISION=precision,
        num_warps=warps,
        num_stages=stages,
    )
