"""Triton kernels for the stream mixes: ``mhc_pre`` (given ``pre``) and ``mhc_post``, forward and backward.

    mhc_pre:  x_in[t, :]   = Σ_i pre[t, i] · X[t, i, :]
    mhc_post: X'[t, j, :]  = post[t, j] · F[t, :] + Σ_i comb[t, i, j] · X[t, i, :]      (X' = post ⊗ F + combᵀ X)

All math in fp32; stream tiles are ``[BT, NP, BD]`` (NP = N padded to a power of two). The backward kernels own
whole token rows (loop over ``D``) so the per-token reductions ``dpre``, ``dpost`` and ``dcomb`` need no atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _pre_fwd_kernel(
    x_ptr, pre_ptr, out_ptr, T, D, N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr
):
    rows = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    dd = tl.program_id(1) * BD + tl.arange(0, BD)
    ip = tl.arange(0, NP)
    rmask = rows < T
    dmask = dd < D
    m3 = rmask[:, None, None] & (ip < N)[None, :, None] & dmask[None, None, :]
    x3 = tl.load(
        x_ptr + rows[:, None, None] * (N * D) + ip[None, :, None] * D + dd[None, None, :], mask=m3, other=0.0
    )
    p = tl.load(pre_ptr + rows[:, None] * N + ip[None, :], mask=rmask[:, None] & (ip < N)[None, :], other=0.0)
    # x_in = Σ_i pre[i] · X[i]
    out = tl.sum(p[:, :, None] * x3.to(tl.float32), 1)
    tl.store(
        out_ptr + rows[:, None] * D + dd[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=rmask[:, None] & dmask[None, :],
    )


@triton.jit
def _pre_bwd_kernel(
    x_ptr,
    pre_ptr,
    dout_ptr,
    dx_ptr,
    dpre_ptr,
    T,
    D,
    N: tl.constexpr,
    NP: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    rows = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    ip = tl.arange(0, NP)
    rmask = rows < T
    pmask = rmask[:, None] & (ip < N)[None, :]
    p = tl.load(pre_ptr + rows[:, None] * N + ip[None, :], mask=pmask, other=0.0)
    dpre = tl.zeros([BT, NP], tl.float32)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        dmask = dd < D
        m3 = pmask[:, :, None] & dmask[None, None, :]
        offs = rows[:, None, None] * (N * D) + ip[None, :, None] * D + dd[None, None, :]
        x3 = tl.load(x_ptr + offs, mask=m3, other=0.0).to(tl.float32)
        do = tl.load(
            dout_ptr + rows[:, None] * D + dd[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0
        )
        do = do.to(tl.float32)
        # dX[i] = pre[i] · dx_in ;  dpre[i] = Σ_d dx_in · X[i]
        tl.store(dx_ptr + offs, (p[:, :, None] * do[:, None, :]).to(dx_ptr.dtype.element_ty), mask=m3)
        dpre += tl.sum(x3 * do[:, None, :], 2)
    tl.store(dpre_ptr + rows[:, None] * N + ip[None, :], dpre, mask=pmask)


@triton.jit
def _post_fwd_kernel(
    f_ptr,
    x_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    T,
    D,
    N: tl.constexpr,
    NP: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    rows = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    dd = tl.program_id(1) * BD + tl.arange(0, BD)
    ip = tl.arange(0, NP)
    rmask = rows < T
    dmask = dd < D
    m2 = rmask[:, None] & dmask[None, :]
    pmask = rmask[:, None] & (ip < N)[None, :]
    x3 = tl.load(
        x_ptr + rows[:, None, None] * (N * D) + ip[None, :, None] * D + dd[None, None, :],
        mask=pmask[:, :, None] & dmask[None, None, :],
        other=0.0,
    ).to(tl.float32)
    f = tl.load(f_ptr + rows[:, None] * D + dd[None, :], mask=m2, other=0.0).to(tl.float32)
    for j in tl.static_range(N):
        # X'[j] = post[j] · F + Σ_i comb[i, j] · X[i]   (combᵀ X: contract over comb's first index)
        c_j = tl.load(comb_ptr + rows[:, None] * (N * N) + ip[None, :] * N + j, mask=pmask, other=0.0)
        p_j = tl.load(post_ptr + rows * N + j, mask=rmask, other=0.0)
        o = p_j[:, None] * f + tl.sum(c_j[:, :, None] * x3, 1)
        tl.store(
            out_ptr + rows[:, None] * (N * D) + j * D + dd[None, :], o.to(out_ptr.dtype.element_ty), mask=m2
        )


@triton.jit
def _post_bwd_kernel(
    f_ptr,
    x_ptr,
    post_ptr,
    comb_ptr,
    dout_ptr,
    df_ptr,
    dx_ptr,
    dpost_ptr,  # [DSPLIT, T, N] fp32 (partial sums per D range when DSPLIT > 1)
    dcomb_ptr,  # [DSPLIT, T, N, N] fp32
    T,
    D,
    d_per_split,  # D range per program along axis 1 (a multiple of BD, or >= D)
    N: tl.constexpr,
    NP: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    rows = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    pid_s = tl.program_id(1)
    ip = tl.arange(0, NP)
    rmask = rows < T
    pmask = rmask[:, None] & (ip < N)[None, :]
    dpost = tl.zeros([BT, NP], tl.float32)
    dcomb = tl.zeros([BT, NP, NP], tl.float32)
    d_lo = pid_s * d_per_split
    for d0 in range(0, d_per_split, BD):
        dd = d_lo + d0 + tl.arange(0, BD)
        dmask = dd < D
        m2 = rmask[:, None] & dmask[None, :]
        m3 = pmask[:, :, None] & dmask[None, None, :]
        offs3 = rows[:, None, None] * (N * D) + ip[None, :, None] * D + dd[None, None, :]
        x3 = tl.load(x_ptr + offs3, mask=m3, other=0.0).to(tl.float32)
        f = tl.load(f_ptr + rows[:, None] * D + dd[None, :], mask=m2, other=0.0).to(tl.float32)
        dx3 = tl.zeros([BT, NP, BD], tl.float32)
        df = tl.zeros([BT, BD], tl.float32)
        for j in tl.static_range(N):
            c_j = tl.load(comb_ptr + rows[:, None] * (N * N) + ip[None, :] * N + j, mask=pmask, other=0.0)
            p_j = tl.load(post_ptr + rows * N + j, mask=rmask, other=0.0)
            do_j = tl.load(dout_ptr + rows[:, None] * (N * D) + j * D + dd[None, :], mask=m2, other=0.0)
            do_j = do_j.to(tl.float32)
            # dF = Σ_j post[j] dX'[j];  dX[i] = Σ_j comb[i, j] dX'[j]
            df += p_j[:, None] * do_j
            dx3 += c_j[:, :, None] * do_j[:, None, :]
            # dpost[j] = Σ_d dX'[j] F;  dcomb[i, j] = Σ_d dX'[j] X[i]
            dpost += tl.where(ip[None, :] == j, tl.sum(do_j * f, 1)[:, None], 0.0)
            v = tl.sum(x3 * do_j[:, None, :], 2)
            dcomb += tl.where(ip[None, None, :] == j, v[:, :, None], 0.0)
        tl.store(df_ptr + rows[:, None] * D + dd[None, :], df.to(df_ptr.dtype.element_ty), mask=m2)
        tl.store(dx_ptr + offs3, dx3.to(dx_ptr.dtype.element_ty), mask=m3)
    prow = pid_s.to(tl.int64) * T + rows  # row of this D range's partial sums
    tl.store(dpost_ptr + prow[:, None] * N + ip[None, :], dpost, mask=pmask)
    cmask = pmask[:, :, None] & (ip < N)[None, None, :]
    tl.store(
        dcomb_ptr + prow[:, None, None] * (N * N) + ip[None, :, None] * N + ip[None, None, :],
        dcomb,
        mask=cmask,
    )


@triton.jit
def _collapse_dpre_kernel(
    x_ptr,  # [T, N, D]
    dout_ptr,  # [T, D] grad of x_in
    dpre_in_ptr,  # [T, N] fp32 incoming grad of pre (HAS_DPRE)
    dpre_ptr,  # [T, N] fp32 out
    T,
    D,
    N: tl.constexpr,
    NP: tl.constexpr,
    HAS_DPRE: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    """``dpre[t, i] = dpre_in[t, i] + Σ_d dx_in[t, d] · X[t, i, d]``: the collapse's weight gradient alone.

    A pure streaming reduction (no ``dX``): products are accumulated elementwise in registers over the D loop and
    reduced across threads once at the end, so the loop body is loads + FMAs only.
    """
    rows = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    ip = tl.arange(0, NP)
    rmask = rows < T
    pmask = rmask[:, None] & (ip < N)[None, :]
    acc = tl.zeros([BT, NP, BD], tl.float32)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        dmask = dd < D
        x3 = tl.load(
            x_ptr + rows[:, None, None] * (N * D) + ip[None, :, None] * D + dd[None, None, :],
            mask=pmask[:, :, None] & dmask[None, None, :],
            other=0.0,
        )
        do = tl.load(
            dout_ptr + rows[:, None] * D + dd[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0
        )
        acc += x3.to(tl.float32) * do.to(tl.float32)[:, None, :]
    dpre = tl.sum(acc, 2)
    if HAS_DPRE:
        dpre += tl.load(dpre_in_ptr + rows[:, None] * N + ip[None, :], mask=pmask, other=0.0)
    tl.store(dpre_ptr + rows[:, None] * N + ip[None, :], dpre, mask=pmask)
