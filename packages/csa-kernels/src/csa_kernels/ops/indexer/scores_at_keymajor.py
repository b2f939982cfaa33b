"""Atomic-free, bitwise-reproducible ``dk`` of the index scores at given entries (key-major pass).

Math (``g[t, j]`` the upstream gradient of slot ``j``, ``G[t, e] = sum_{j: idx[t,j] = e} g[t, j]``)::

    dk[e, :] = sum_t sum_h G[t, e] * w[t, h] * [<q[t,h], k[e]> > 0] * q[t, h, :]

Schedule: the transposed index of :mod:`csa_kernels.ops.sparse_attn.dkv_keymajor` (each row's valid entries sorted
by a stable integer sort, ``g`` gathered in the same order; per entry block of ``BLOCK_R`` rows the ascending list of
the tokens that selected any of them). One program per (entry block, split) keeps the ``[BLOCK_R, DI]`` key block
resident and walks its tokens: ``G`` of the block's rows from the token's segment (fp32, slot order), then per head
block ``sT = k_b qᵀ`` (``[BLOCK_R, BLOCK_H]``) and ``acc += dsT q`` (``[BLOCK_R, DI]`` fp32). The splits' fp32
partials are summed in a fixed order. Two runs give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from csa_kernels._triton_utils import interpreting, next_pow2
from csa_kernels.ops.sparse_attn.dkv_keymajor import n_splits, sort_rows, transposed_index


@triton.jit
def _dk_keymajor_kernel(
    Q,
    K,
    W,
    SIDX,
    SG,
    SEG_START,
    SEG_END,
    TOK,
    NTOK,
    TOK_OFF,
    PART,
    stride_qt,
    stride_qh,
    stride_kc,
    stride_wt,
    stride_it,
    stride_ps,
    stride_pn,
    T,
    HI,
    NK,
    n_split,
    DI: tl.constexpr,
    BLOCK_DI: tl.constexpr,
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
        mr = rows < NK
        offs_d = tl.arange(0, BLOCK_DI)
        md = offs_d < DI
        kb = tl.load(
            K + rows.to(tl.int64)[:, None] * stride_kc + offs_d[None, :],
            mask=mr[:, None] & md[None, :],
            other=0.0,
        )  # [BLOCK_R, BLOCK_DI]
        if UPCAST:
            kb = kb.to(tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_DI], dtype=tl.float32)
        for i in range(i0, i1):
            t = tl.load(TOK + off + i).to(tl.int64)
            st = tl.load(SEG_START + b.to(tl.int64) * T + t)
            en = tl.load(SEG_END + b.to(tl.int64) * T + t)
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
        tl.store(
            PART + sp.to(tl.int64) * stride_ps + rows.to(tl.int64)[:, None] * stride_pn + offs_d[None, :],
            acc,
            mask=mr[:, None] & md[None, :],
        )


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
    T, HI, DI = q.shape
    n_rows = k.shape[0]
    block_r, block_h, warps, stages = _config(HI, DI, q.dtype == torch.float32)
    nb = triton.cdiv(max(n_rows, 1), block_r)
    sidx, order, counts = sort_rows(indices)
    sg = torch.where(indices >= 0, grad.float(), 0.0).gather(1, order).contiguous()  # g in sorted slot order
    seg_start, seg_end, tok, ntok, tok_off = transposed_index(sidx, counts, n_rows, block_r)
    n_split = n_splits(nb, block_r, DI)
    part = torch.zeros((n_split, nb * block_r, DI), dtype=torch.float32, device=k.device)
    _dk_keymajor_kernel[(nb, n_split)](
        q,
        k,
        w,
        sidx,
        sg,
        seg_start,
        seg_end,
        tok,
        ntok,
        tok_off,
        part,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        w.stride(0),
        sidx.stride(0),
        part.stride(0),
        part.stride(1),
        T,
        HI,
        n_rows,
        n_split,
        DI=DI,
        BLOCK_DI=max(16, next_pow2(DI)),
        BLOCK_H=block_h,
        BLOCK_R=block_r,
        BLOCK_S=16 if interpreting() else 64,
        UPCAST=interpreting(),
        PRECISION=precision,
        num_warps=warps,
        num_stages=stages,
    )
    return part.sum(0)[:n_rows]
