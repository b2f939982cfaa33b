"""Backward of the mHC coefficients, tuned launch set: the ``dX`` / ``dfn`` pass over stream-aligned columns.

``mix = rstd · (x @ fn.T)`` and ``x_in = Σ_i pre_i X_i`` give, per token (``c = rstd² · (dmix · mix) / K``)::

    dX[i, d] = rstd · (dmix @ fn)[i·D + d] - X[i, d] · c + pre_i · dx_in[d]
    dfn      = Σ_t (rstd · dmix)ᵀ X

One program = one column chunk ``[BK]`` of ONE stream ``i`` (so ``pre_i`` is a per-row scalar, not a gathered
``[BT, BK]`` tile) x one token range; X is read once for both outputs, ``dfn`` partials per token range are
reduced on the host. Chunks of the N streams of the same ``d`` range are neighbours in the grid, so ``dx_in`` is
read from HBM about once and from L2 for the other streams. The ``dfn`` GEMM is computed transposed,
``dfnᵀ[BK, MP] += Xᵀ[BK, BT] @ (rstd·dmix)[BT, MP]``, which gives it an M = BK >= 64 tile (a warpgroup MMA)
instead of M = 24 padded to 32. Dot precision as in ``coefficients_triton._mm`` (``ops/precision.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mhc.ops.coefficients_triton import _mm


@triton.jit
def _coeff_bwd_dx_dfn_stream_kernel(
    x_ptr,  # [T, K] streams, K = N·D
    dout_ptr,  # [T, D] grad of x_in (APPLY)
    pre_ptr,  # [T, N] (APPLY)
    dmix_ptr,  # [T, M]
    c_ptr,  # [T]  rstd² · (dmix · mix) / K
    rstd_ptr,  # [T]
    fn_ptr,  # [M, K]
    dx_ptr,  # [T, K] out
    part_ptr,  # [SPLIT_T, M, K] fp32 out: partial dfn per token range
    T,
    D,
    rows_per_split,  # multiple of BT
    N: tl.constexpr,
    M: tl.constexpr,
    MP: tl.constexpr,
    APPLY: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,  # _mm's bf16 split of the dfn dot: 0 or 1 (Xᵀ bf16 exact, rstd·dmix split)
    PREC: tl.constexpr,
    INTERP: tl.constexpr,
):
    pid_k = tl.program_id(0)
    pid_s = tl.program_id(1)
    K = N * D
    si = pid_k % N  # stream of this chunk; the N streams of one d range are neighbouring programs
    dd = (pid_k // N) * BK + tl.arange(0, BK)
    dmask = dd < D
    kk = si * D + dd
    cm = tl.arange(0, MP)
    cm_ok = cm < M
    w = tl.load(fn_ptr + cm[:, None] * K + kk[None, :], mask=cm_ok[:, None] & dmask[None, :], other=0.0)
    acc = tl.zeros([BK, MP], tl.float32)  # dfnᵀ of this chunk
    t_start = pid_s * rows_per_split
    for t0 in range(0, rows_per_split, BT):
        rows = (t_start + t0 + tl.arange(0, BT)).to(tl.int64)
        rmask = rows < T
        m2 = rmask[:, None] & dmask[None, :]
        dmix = tl.load(
            dmix_ptr + rows[:, None] * M + cm[None, :], mask=rmask[:, None] & cm_ok[None, :], other=0.0
        )  # [BT, MP]
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        c = tl.load(c_ptr + rows, mask=rmask, other=0.0)
        xt = tl.load(x_ptr + rows[:, None] * K + kk[None, :], mask=m2, other=0.0)  # [BT, BK]
        g = _mm(dmix, w, tl.zeros([BT, BK], tl.float32), 0, PREC, INTERP)  # dmix @ fn
        dx = rstd[:, None] * g - xt.to(tl.float32) * c[:, None]
        if APPLY:
            p = tl.load(pre_ptr + rows * N + si, mask=rmask, other=0.0)
            do = tl.load(dout_ptr + rows[:, None] * D + dd[None, :], mask=m2, other=0.0)
            dx += p[:, None] * do.to(tl.float32)
        tl.store(dx_ptr + rows[:, None] * K + kk[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m2)
        # dfnᵀ += Xᵀ @ (rstd · dmix)
        acc = _mm(tl.trans(xt), dmix * rstd[:, None], acc, SPLIT, PREC, INTERP)
    base = part_ptr + pid_s.to(tl.int64) * M * K
    tl.store(base + cm[None, :] * K + kk[:, None], acc, mask=cm_ok[None, :] & dmask[:, None])
