"""Split-K forward of the mHC coefficients (and the fused ``pre`` collapse): enough programs to fill the GPU.

The projection ``x @ fn.T`` reduces over ``K = N·D`` (16384 for V4-Flash) but has only ``M = 24`` outputs per
token, so one program per token block (the fused kernel in ``coefficients_triton.py``) leaves most SMs idle at
a few thousand tokens (T = 4096, 64-token blocks: 64 programs for 132 SMs, each looping over all of K).

    _coeff_fwd_partial_kernel   grid (token blocks, SPLIT): program (b, s) reads the rows of block b over the
                                K range s once and writes the partial projection and partial ``Σx²``:
                                part [SPLIT, T, MP] fp32, ssq [SPLIT, T] fp32 (MP = M padded to a power of two)
    _coeff_fwd_finish_kernel    grid (token blocks, D blocks): sums the partials (fixed order: deterministic),
                                ``rstd``, ``mix``, the gates, Sinkhorn (D block 0 only) and, with ``APPLY``, the
                                collapse ``x_in = Σ_i pre_i X_i`` of its D block (the second read of X)

The partials cost ``SPLIT · T · (MP + 1) · 4`` bytes (8 MB at T = 4096, SPLIT = 16), L2-resident, against the
``T · K · 2..4`` bytes of X. The fn tile ``[BK, MP]`` is re-read by every token block (L2 hits, ``M·4/(BT·esize)``
of the stream bytes). Dot precision as in ``coefficients_triton._mm`` (``ops/precision.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mhc.ops.coefficients_triton import _mm
from mhc.ops.sinkhorn_triton import sinkhorn_prefix


@triton.jit
def _coeff_fwd_partial_kernel(
    x_ptr,  # [T, K] streams (K = N·D)
    fn_ptr,  # [M, K] fp32
    part_ptr,  # [SPLIT, T, MP] fp32 out: partial x @ fn.T (padded columns written as 0)
    ssq_ptr,  # [SPLIT, T] fp32 out: partial Σ x²
    T,
    K,
    k_per_split,  # multiple of BK
    M: tl.constexpr,
    MP: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,  # _mm's bf16 split (0 / 1), not the K split
    PREC: tl.constexpr,
    INTERP: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = (pid_t * BT + tl.arange(0, BT)).to(tl.int64)
    rmask = rows < T
    cm = tl.arange(0, MP)
    cm_ok = cm < M
    acc = tl.zeros([BT, MP], tl.float32)
    sumsq = tl.zeros([BT], tl.float32)
    k_lo = pid_s * k_per_split
    for k0 in range(0, k_per_split, BK):
        kk = k_lo + k0 + tl.arange(0, BK)
        kmask = kk < K
        xt = tl.load(x_ptr + rows[:, None] * K + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        xf = xt.to(tl.float32)
        sumsq += tl.sum(xf * xf, 1)
        w = tl.load(fn_ptr + cm[None, :] * K + kk[:, None], mask=cm_ok[None, :] & kmask[:, None], other=0.0)
        acc = _mm(xt, w, acc, SPLIT, PREC, INTERP)  # [BT, MP]
    prow = pid_s.to(tl.int64) * T + rows
    tl.store(part_ptr + prow[:, None] * MP + cm[None, :], acc, mask=rmask[:, None])
    tl.store(ssq_ptr + prow, sumsq, mask=rmask)


@triton.jit
def _sum_part(part_ptr, rows, rmask, cols, cmask, T, n_split, MP: tl.constexpr):
    """``Σ_s part[s, rows, cols]`` in split order (deterministic) -> ``[BT, C]``; masked entries are 0."""
    m2 = rmask[:, None] & cmask[None, :]
    acc = tl.load(part_ptr + rows[:, None] * MP + cols[None, :], mask=m2, other=0.0)
    for s in range(1, n_split):
        prow = s * T + rows
        acc += tl.load(part_ptr + prow[:, None] * MP + cols[None, :], mask=m2, other=0.0)
    return acc


@triton.jit
def _coeff_fwd_finish_kernel(
    part_ptr,  # [SPLIT, T, MP] fp32
    ssq_ptr,  # [SPLIT, T] fp32
    x_ptr,  # [T, N, D] streams (APPLY)
    scale_ptr,  # [3] (or [1] for the head) fp32
    base_ptr,  # [M] fp32
    pre_ptr,  # [T, N] fp32 out
    post_ptr,  # [T, N] fp32 out (HAS_RES)
    comb_ptr,  # [T, N, N] fp32 out (HAS_RES)
    out_ptr,  # [T, D] x_in out (APPLY)
    mix_ptr,  # [T, M] fp32 out, saved for backward
    rstd_ptr,  # [T] fp32 out, saved for backward
    T,
    D,
    n_split,
    norm_eps,
    hc_eps,
    iters,
    N: tl.constexpr,
    NP: tl.constexpr,
    M: tl.constexpr,
    MP: tl.constexpr,
    HAS_RES: tl.constexpr,
    APPLY: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = (pid_t * BT + tl.arange(0, BT)).to(tl.int64)
    rmask = rows < T
    K = N * D
    sumsq = tl.load(ssq_ptr + rows, mask=rmask, other=0.0)
    for s in range(1, n_split):
        sumsq += tl.load(ssq_ptr + s * T + rows, mask=rmask, other=0.0)
    rstd = 1.0 / tl.sqrt(sumsq / K + norm_eps)
    ip = tl.arange(0, NP)  # stream index (pre / post column)
    ip_ok = ip < N
    pmask = rmask[:, None] & ip_ok[None, :]
    # pre = sigmoid(α_pre · mix[0:N] + base[0:N]) + eps   (every program: its collapse needs it)
    mix_pre = _sum_part(part_ptr, rows, rmask, ip, ip_ok, T, n_split, MP) * rstd[:, None]
    a_pre = tl.load(scale_ptr)
    pre = tl.sigmoid(a_pre * mix_pre + tl.load(base_ptr + ip, mask=ip_ok, other=0.0)[None, :]) + hc_eps
    if pid_d == 0:
        tl.store(rstd_ptr + rows, rstd, mask=rmask)
        tl.store(pre_ptr + rows[:, None] * N + ip[None, :], pre, mask=pmask)
        cm = tl.arange(0, MP)
        cm_ok = cm < M
        mix = _sum_part(part_ptr, rows, rmask, cm, cm_ok, T, n_split, MP) * rstd[:, None]
        tl.store(mix_ptr + rows[:, None] * M + cm[None, :], mix, mask=rmask[:, None] & cm_ok[None, :])
        if HAS_RES:
            # post = 2 · sigmoid(α_post · mix[N:2N] + base[N:2N])
            mix_post = _sum_part(part_ptr, rows, rmask, N + ip, ip_ok, T, n_split, MP) * rstd[:, None]
            b_post = tl.load(base_ptr + N + ip, mask=ip_ok, other=0.0)
            post = 2.0 * tl.sigmoid(tl.load(scale_ptr + 1) * mix_post + b_post[None, :])
            tl.store(post_ptr + rows[:, None] * N + ip[None, :], post, mask=pmask)
            # comb = Sinkhorn(α_comb · mix[2N:] + base[2N:])
            cc = tl.arange(0, NP * NP)  # comb entry (i, j) on the padded NP x NP grid
            ci = cc // NP
            cj = cc % NP
            cc_ok = (ci < N) & (cj < N)
            cc_row = 2 * N + ci * N + cj  # row of fn/base for comb[i, j]
            mix_comb = _sum_part(part_ptr, rows, rmask, cc_row, cc_ok, T, n_split, MP) * rstd[:, None]
            b_comb = tl.load(base_ptr + cc_row, mask=cc_ok, other=0.0)
            z = tl.reshape(tl.load(scale_ptr + 2) * mix_comb + b_comb[None, :], [BT, NP, NP])
            valid = tl.reshape(cc_ok, [NP, NP])[None, :, :]
            comb = tl.reshape(sinkhorn_prefix(z, valid, hc_eps, 2 * iters), [BT, NP * NP])
            cmask = rmask[:, None] & cc_ok[None, :]
            tl.store(comb_ptr + rows[:, None] * (N * N) + (ci * N + cj)[None, :], comb, mask=cmask)
    if APPLY:
        # x_in[:, D block] = Σ_i pre[i] · X[i]   (fp32 sum, stored in the output dtype)
        dd = pid_d * BD + tl.arange(0, BD)
        dmask = dd < D
        x3 = tl.load(
            x_ptr + rows[:, None, None] * K + ip[None, :, None] * D + dd[None, None, :],
            mask=pmask[:, :, None] & dmask[None, None, :],
            other=0.0,
        )
        o = tl.sum(pre[:, :, None] * x3.to(tl.float32), 1)
        tl.store(
            out_ptr + rows[:, None] * D + dd[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=rmask[:, None] & dmask[None, :],
        )
