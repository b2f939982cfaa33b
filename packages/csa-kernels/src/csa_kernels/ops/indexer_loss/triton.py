"""Fused Triton indexer KL loss (spec §5.2), forward and backward, never forming ``[T, H, Kc]``.

Per query row ``t`` and valid slot ``s`` (``idx = comp_indices[t, s] >= 0``, ``x = index_scores[t, s]``)::

    lm[t,s] = logsumexp_h( scale * <q[t,h], kv_all[idx]> - lse[t,h] )     (teacher log-mass, heads summed)
    Lp[t]   = logsumexp_s lm[t,s],   Lr[t] = logsumexp_s x[t,s]
    KL[t]   = sum_s p (log p - log r) = A[t] / l[t] - Lp[t] + Lr[t],  A = sum_s e^{lm} (lm - x), l = sum_s e^{lm}

Forward: one program per token; the token's heads sit on the MMA M dimension (blocks of BLOCK_H, looped when
H > BLOCK_H) and share each gathered block of BLOCK_N candidate rows (the same schedule as the sparse attention
forward, without the value GEMM). The head-logsumexp of each ``[BLOCK_H, BLOCK_N]`` logit tile is folded into
``lm [BLOCK_N]`` at once, and ``lm`` and ``x`` are reduced with online (rescaled) sums, so only ``lm [T, Kc]`` (the
size of ``index_scores``) and three per-row statistics are written.

Backward (only ``index_scores`` gets a gradient): ``dx[t,s] = g[t] * (exp(x - Lr) - exp(lm - Lp))`` at valid slots,
``g[t] = d per_row_kl[t]`` (the mean over rows is applied by the caller through autograd), elementwise from the
saved ``lm`` and statistics: no GEMM is repeated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from csa_kernels._triton_utils import check_triton_device, interpreting, next_pow2

LOG2E = 1.4426950408889634


@triton.jit
def _head_lse2(
    Q,
    KV_T,
    t,
    LSE,
    stride_qt,
    stride_qh,
    offs_h0,
    offs_d,
    H,
    D,
    qk_scale_log2,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """log2-sum-exp2 over one block of heads of ``scale*<q, kv> * log2e - lse * log2e``: ``[BLOCK_N]``."""
    mh = offs_h0 < H
    q = tl.load(
        Q + t * stride_qt + offs_h0[:, None] * stride_qh + offs_d[None, :],
        mask=mh[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    lse2 = tl.load(LSE + t * H + offs_h0, mask=mh, other=0.0) * 1.4426950408889634
    s = tl.dot(q, KV_T, input_precision=PRECISION) * qk_scale_log2 - lse2[:, None]  # [BLOCK_H, BLOCK_N]
    s = tl.where(mh[:, None], s, -float("inf"))
    cm = tl.max(s, 0)  # finite: at least one head is live
    return cm + tl.log2(tl.sum(tl.exp2(s - cm[None, :]), 0))


@triton.jit
def _indexer_loss_fwd_kernel(
    Q,
    KV,
    LSE,
    IDX,
    XS,
    LM,
    KL,
    STATS,
    stride_qt,
    stride_qh,
    stride_kvn,
    stride_it,
    stride_xt,
    stride_lmt,
    H,
    KC,
    qk_scale_log2,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_HB: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_H)
    mask_d = offs_d < D
    zero = tl.sum(tl.zeros([BLOCK_N], dtype=tl.float32), 0)  # fp32 scalar for loop-carried statistics
    m_p = zero - 1.0e30  # running max of lm
    l_p = zero  # sum exp(lm - m_p)
    a_p = zero  # sum exp(lm - m_p) * (lm - x)
    m_r = zero - 1.0e30  # running max of x
    l_r = zero  # sum exp(x - m_r)
    for start in range(0, KC, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        inb = offs_n < KC
        idx = tl.load(IDX + t * stride_it + offs_n, mask=inb, other=-1).to(tl.int64)
        valid = idx >= 0
        kv = tl.load(
            KV + tl.maximum(idx, 0)[:, None] * stride_kvn + offs_d[None, :],
            mask=valid[:, None] & mask_d[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        if UPCAST:
            kv = kv.to(tl.float32)
        kv_t = tl.trans(kv)
        lm2 = _head_lse2(
            Q, kv_t, t, LSE, stride_qt, stride_qh, offs_h, offs_d, H, D, qk_scale_log2, PRECISION, UPCAST
        )
        for hb in tl.static_range(1, NUM_HB):
            part = _head_lse2(
                Q,
                kv_t,
                t,
                LSE,
                stride_qt,
                stride_qh,
                hb * BLOCK_H + offs_h,
                offs_d,
                H,
                D,
                qk_scale_log2,
                PRECISION,
                UPCAST,
            )
            mx = tl.maximum(lm2, part)
            lm2 = mx + tl.log2(tl.exp2(lm2 - mx) + tl.exp2(part - mx))
        lm = tl.where(valid, lm2 * 0.6931471805599453, -float("inf"))  # natural log
        tl.store(LM + t * stride_lmt + offs_n, lm, mask=inb)
        x = tl.load(XS + t * stride_xt + offs_n, mask=valid, other=0.0).to(tl.float32)
        # teacher: online sums of e^{lm} and e^{lm} (lm - x)
        m_new = tl.maximum(m_p, tl.max(tl.where(valid, lm, -1.0e30), 0))
        alpha = tl.exp(m_p - m_new)
        ep = tl.where(valid, tl.exp(lm - m_new), 0.0)
        l_p = l_p * alpha + tl.sum(ep, 0)
        a_p = a_p * alpha + tl.sum(ep * tl.where(valid, lm - x, 0.0), 0)
        m_p = m_new
        # student: online logsumexp of x
        r_new = tl.maximum(m_r, tl.max(tl.where(valid, x, -1.0e30), 0))
        l_r = l_r * tl.exp(m_r - r_new) + tl.sum(tl.exp(tl.where(valid, x - r_new, -float("inf"))), 0)
        m_r = r_new
    has = l_p > 0
    lp = m_p + tl.log(tl.where(has, l_p, 1.0))
    lr = m_r + tl.log(tl.where(has, l_r, 1.0))
    kl = tl.where(has, a_p / tl.where(has, l_p, 1.0) - lp + lr, 0.0)
    tl.store(KL + t, kl)
    tl.store(STATS + t * 2, lp)
    tl.store(STATS + t * 2 + 1, lr)


@triton.jit
def _indexer_loss_bwd_kernel(
    XS,
    LM,
    STATS,
    G,
    DX,
    stride_xt,
    stride_lmt,
    stride_dxt,
    KC,
    BLOCK_N: tl.constexpr,
):
    """dx[t, s] = g[t] * (softmax(x)[s] - p[s]) at valid slots (lm finite), 0 elsewhere."""
    t = tl.program_id(0).to(tl.int64)
    lp = tl.load(STATS + t * 2)
    lr = tl.load(STATS + t * 2 + 1)
    g = tl.load(G + t).to(tl.float32)
    for start in range(0, KC, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        inb = offs_n < KC
        lm = tl.load(LM + t * stride_lmt + offs_n, mask=inb, other=-float("inf"))
        valid = lm > -float("inf")
        x = tl.load(XS + t * stride_xt + offs_n, mask=inb & valid, other=0.0).to(tl.float32)
        d = tl.exp(tl.where(valid, x - lr, -float("inf"))) - tl.exp(tl.where(valid, lm - lp, -float("inf")))
        dx = g * d
        tl.store(DX + t * stride_dxt + offs_n, dx.to(DX.dtype.element_ty), mask=inb)


# (BLOCK_H, BLOCK_N, num_warps, num_stages) of the forward on the GPU; benchmarks may override it.
FWD_CONFIG_OVERRIDE: tuple[int, int, int, int] | None = None


def _fwd_config(H: int, D: int) -> tuple[int, int, int, int]:
    if interpreting():
        return min(next_pow2(H), 64), 16, 4, 1
    if FWD_CONFIG_OVERRIDE is not None:
        return FWD_CONFIG_OVERRIDE
    block_h = 64 if H >= 64 else max(16, next_pow2(H))
    if D <= 256:
        return block_h, 64, 8, 1
    # H200 sweep at V4-Flash (H 64, D 512, top-k 512, S 4096): BLOCK_N 128 1.45 ms, 64 1.73 ms, 32 2.34 ms. With
    # several head blocks (H > 64) the extra q tiles need shared memory, so those keep the smaller tile.
    return block_h, 128 if block_h >= H else 32, 8, 1


def indexer_loss_fwd(
    q: torch.Tensor,  # [T, H, D]
    kv_all: torch.Tensor,  # [Nkv, D]
    lse: torch.Tensor,  # [T, H] fp32
    comp_indices: torch.Tensor,  # [T, Kc] int
    index_scores: torch.Tensor,  # [T, Kc]
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(per_row_kl [T] fp32, lm [T, Kc] fp32 teacher log-mass (-inf at -1), stats [T, 2] fp32 (Lp, Lr))``."""
    check_triton_device(q, kv_all, lse, comp_indices, index_scores)
    T, H, D = q.shape
    kc = comp_indices.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv_all = kv_all.contiguous()
    lse = lse.float().contiguous()
    idx = comp_indices if comp_indices.stride(-1) == 1 else comp_indices.contiguous()
    xs = index_scores if index_scores.stride(-1) == 1 else index_scores.contiguous()
    kl = torch.zeros(T, dtype=torch.float32, device=q.device)
    lm = torch.full((T, kc), float("-inf"), dtype=torch.float32, device=q.device)
    stats = torch.zeros((T, 2), dtype=torch.float32, device=q.device)
    if T == 0 or kc == 0:
        return kl, lm, stats
    block_h, block_n, warps, stages = _fwd_config(H, D)
    if q.dtype != kv_all.dtype:
        kv_all = kv_all.to(q.dtype)
    _indexer_loss_fwd_kernel[(T,)](
        q,
        kv_all,
        lse,
        idx,
        xs,
        lm,
        kl,
        stats,
        q.stride(0),
        q.stride(1),
        kv_all.stride(0),
        idx.stride(0),
        xs.stride(0),
        lm.stride(0),
        H,
        kc,
        softmax_scale * LOG2E,
        D=D,
        BLOCK_D=next_pow2(D),
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        NUM_HB=triton.cdiv(H, block_h),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreting(),
        num_warps=warps,
        num_stages=stages,
    )
    return kl, lm, stats


def indexer_loss_bwd(
    index_scores: torch.Tensor, lm: torch.Tensor, stats: torch.Tensor, g: torch.Tensor
) -> torch.Tensor:
    """``d index_scores [T, Kc]`` (dtype of ``index_scores``) from ``g = d per_row_kl [T]``."""
    T, kc = lm.shape
    xs = index_scores if index_scores.stride(-1) == 1 else index_scores.contiguous()
    dx = torch.empty(xs.shape, dtype=index_scores.dtype, device=xs.device)
    if T == 0 or kc == 0:
        return dx.zero_()
    block_n = min(next_pow2(kc), 64 if interpreting() else 1024)
    _indexer_loss_bwd_kernel[(T,)](
        xs,
        lm,
        stats,
        g.float().contiguous(),
        dx,
        xs.stride(0),
        lm.stride(0),
        dx.stride(0),
        kc,
        BLOCK_N=block_n,
    )
    return dx
