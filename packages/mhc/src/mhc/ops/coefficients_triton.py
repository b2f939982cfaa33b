"""Fused Triton kernels: mHC coefficients (RMS + projection + sigmoid + Sinkhorn), optionally fused with ``mhc_pre``.

Forward (one program = ``BT`` tokens):
    pass 1 over the ``N·D`` stream values: ``Σx²`` and three small GEMMs ``x @ fn[pre|post|comb].T`` (tl.dot);
    then ``rstd``, the gates and Sinkhorn in registers; with ``APPLY`` a second pass over the same (L2-hot) rows
    writes ``x_in = Σ_i pre_i · X_i``. Saved for backward: ``mix [T, M]`` and ``rstd [T]`` (M = 24 floats/token).
Backward:
    ``_coeff_bwd_kernel``  dpre (+ Σ_d dx_in·X_i when fused), gate derivatives, Sinkhorn recomputed -> ``dz``, ``dmix``
    ``_coeff_bwd_dx_kernel`` ``dX = pre_i·dx_in + rstd·(dmix @ fn) - X·rstd²·(dmix·mix)/(N·D)``
    ``_dfn_kernel``         ``dfn = Σ_t (rstd·dmix)ᵀ X`` (split over tokens, partial sums reduced on the host)
The HyperHead (§6.4) is the same kernel with ``HAS_RES=False``: only the ``pre`` group, no Sinkhorn.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mhc.ops.sinkhorn_triton import sinkhorn_bwd, sinkhorn_prefix


@triton.jit
def _coeff_fwd_kernel(
    x_ptr,  # [T, N*D] streams
    fn_ptr,  # [M, N*D] fp32
    scale_ptr,  # [3] (or [1] for the head) fp32
    base_ptr,  # [M] fp32
    pre_ptr,  # [T, N] fp32
    post_ptr,  # [T, N] fp32
    comb_ptr,  # [T, N, N] fp32
    out_ptr,  # [T, D] x_in (APPLY)
    mix_ptr,  # [T, M] fp32, saved for backward
    rstd_ptr,  # [T] fp32, saved for backward
    T,
    D,
    norm_eps,
    hc_eps,
    iters,
    N: tl.constexpr,
    NP: tl.constexpr,
    PW: tl.constexpr,
    M: tl.constexpr,
    HAS_RES: tl.constexpr,
    APPLY: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BD: tl.constexpr,
    PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = (pid * BT + tl.arange(0, BT)).to(tl.int64)
    rmask = rows < T
    K = N * D
    cp = tl.arange(0, PW)  # pre / post column
    cp_ok = cp < N
    cc = tl.arange(0, NP * NP)  # comb entry (i, j) on the padded NP x NP grid
    ci = cc // NP
    cj = cc % NP
    cc_ok = (ci < N) & (cj < N)
    cc_row = 2 * N + ci * N + cj  # row of fn/base for comb[i, j]

    acc_pre = tl.zeros([BT, PW], tl.float32)
    acc_post = tl.zeros([BT, PW], tl.float32)
    acc_comb = tl.zeros([BT, NP * NP], tl.float32)
    sumsq = tl.zeros([BT], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < K
        xt = tl.load(
            x_ptr + rows[:, None] * K + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0
        ).to(tl.float32)
        # mean(vec(X)^2) and mix = x @ fn.T (normalisation applied after the matmul)
        sumsq += tl.sum(xt * xt, 1)
        w = tl.load(fn_ptr + cp[None, :] * K + kk[:, None], mask=cp_ok[None, :] & kmask[:, None], other=0.0)
        acc_pre = tl.dot(xt, w, acc_pre, input_precision=PREC)
        if HAS_RES:
            w = tl.load(
                fn_ptr + (N + cp[None, :]) * K + kk[:, None], mask=cp_ok[None, :] & kmask[:, None], other=0.0
            )
            acc_post = tl.dot(xt, w, acc_post, input_precision=PREC)
            w = tl.load(
                fn_ptr + cc_row[None, :] * K + kk[:, None], mask=cc_ok[None, :] & kmask[:, None], other=0.0
            )
            acc_comb = tl.dot(xt, w, acc_comb, input_precision=PREC)
    rstd = 1.0 / tl.sqrt(sumsq / K + norm_eps)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)

    # pre = sigmoid(α_pre · mix[0:N] + base[0:N]) + eps
    mix_pre = acc_pre * rstd[:, None]
    tl.store(mix_ptr + rows[:, None] * M + cp[None, :], mix_pre, mask=rmask[:, None] & cp_ok[None, :])
    a_pre = tl.load(scale_ptr)
    pre = tl.sigmoid(a_pre * mix_pre + tl.load(base_ptr + cp, mask=cp_ok, other=0.0)[None, :]) + hc_eps
    tl.store(pre_ptr + rows[:, None] * N + cp[None, :], pre, mask=rmask[:, None] & cp_ok[None, :])
    if HAS_RES:
        # post = 2 · sigmoid(α_post · mix[N:2N] + base[N:2N])
        mix_post = acc_post * rstd[:, None]
        tl.store(
            mix_ptr + rows[:, None] * M + N + cp[None, :], mix_post, mask=rmask[:, None] & cp_ok[None, :]
        )
        a_post = tl.load(scale_ptr + 1)
        b_post = tl.load(base_ptr + N + cp, mask=cp_ok, other=0.0)
        post = 2.0 * tl.sigmoid(a_post * mix_post + b_post[None, :])
        tl.store(post_ptr + rows[:, None] * N + cp[None, :], post, mask=rmask[:, None] & cp_ok[None, :])
        # comb = Sinkhorn(α_comb · mix[2N:] + base[2N:])
        mix_comb = acc_comb * rstd[:, None]
        cmask = rmask[:, None] & cc_ok[None, :]
        tl.store(mix_ptr + rows[:, None] * M + cc_row[None, :], mix_comb, mask=cmask)
        a_comb = tl.load(scale_ptr + 2)
        b_comb = tl.load(base_ptr + cc_row, mask=cc_ok, other=0.0)
        z = tl.reshape(a_comb * mix_comb + b_comb[None, :], [BT, NP, NP])
        valid = tl.reshape(cc_ok, [NP, NP])[None, :, :]
        comb = tl.reshape(sinkhorn_prefix(z, valid, hc_eps, 2 * iters), [BT, NP * NP])
        tl.store(comb_ptr + rows[:, None] * (N * N) + (ci * N + cj)[None, :], comb, mask=cmask)

    if APPLY:
        # x_in = Σ_i pre[i] · X[i]   (fp32 sum, stored in the output dtype)
        for d0 in range(0, D, BD):
            dd = d0 + tl.arange(0, BD)
            m2 = rmask[:, None] & (dd < D)[None, :]
            acc = tl.zeros([BT, BD], tl.float32)
            for i in tl.static_range(N):
                p_i = tl.sum(tl.where(cp[None, :] == i, pre, 0.0), 1)
                xi = tl.load(x_ptr + rows[:, None] * K + i * D + dd[None, :], mask=m2, other=0.0)
                acc += p_i[:, None] * xi.to(tl.float32)
            tl.store(out_ptr + rows[:, None] * D + dd[None, :], acc.to(out_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _coeff_bwd_kernel(
    x_ptr,  # [T, N*D]
    dout_ptr,  # [T, D] grad of x_in (APPLY)
    pre_ptr,  # [T, N]  (unused unless APPLY; kept for symmetry)
    dpre_ptr,  # [T, N] grad of pre (HAS_DPRE)
    dpost_ptr,  # [T, N] (HAS_RES)
    dcomb_ptr,  # [T, N, N] (HAS_RES)
    mix_ptr,  # [T, M]
    scale_ptr,
    base_ptr,
    dz_ptr,  # [T, M] out: grad of the gate pre-activations α·mix + base
    dmix_ptr,  # [T, M] out: grad of mix (= α · dz)
    T,
    D,
    hc_eps,
    iters,
    N: tl.constexpr,
    NP: tl.constexpr,
    PW: tl.constexpr,
    M: tl.constexpr,
    HAS_RES: tl.constexpr,
    APPLY: tl.constexpr,
    HAS_DPRE: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = (pid * BT + tl.arange(0, BT)).to(tl.int64)
    rmask = rows < T
    K = N * D
    cp = tl.arange(0, PW)
    cp_ok = cp < N
    pmask = rmask[:, None] & cp_ok[None, :]

    dpre = tl.zeros([BT, PW], tl.float32)
    if HAS_DPRE:
        dpre += tl.load(dpre_ptr + rows[:, None] * N + cp[None, :], mask=pmask, other=0.0)
    if APPLY:
        # d pre[i] += Σ_d dx_in[d] · X[i, d]
        for d0 in range(0, D, BD):
            dd = d0 + tl.arange(0, BD)
            m2 = rmask[:, None] & (dd < D)[None, :]
            do = tl.load(dout_ptr + rows[:, None] * D + dd[None, :], mask=m2, other=0.0).to(tl.float32)
            for i in tl.static_range(N):
                xi = tl.load(x_ptr + rows[:, None] * K + i * D + dd[None, :], mask=m2, other=0.0)
                v = tl.sum(do * xi.to(tl.float32), 1)
                dpre += tl.where(cp[None, :] == i, v[:, None], 0.0)

    # pre = sigmoid(u) + eps  ->  du = dpre · σ(1-σ)
    a_pre = tl.load(scale_ptr)
    mix_pre = tl.load(mix_ptr + rows[:, None] * M + cp[None, :], mask=pmask, other=0.0)
    sg = tl.sigmoid(a_pre * mix_pre + tl.load(base_ptr + cp, mask=cp_ok, other=0.0)[None, :])
    dz_pre = dpre * sg * (1.0 - sg)
    tl.store(dz_ptr + rows[:, None] * M + cp[None, :], dz_pre, mask=pmask)
    tl.store(dmix_ptr + rows[:, None] * M + cp[None, :], a_pre * dz_pre, mask=pmask)
    if HAS_RES:
        # post = 2 σ(u)  ->  du = dpost · 2σ(1-σ)
        a_post = tl.load(scale_ptr + 1)
        mix_post = tl.load(mix_ptr + rows[:, None] * M + N + cp[None, :], mask=pmask, other=0.0)
        sg = tl.sigmoid(a_post * mix_post + tl.load(base_ptr + N + cp, mask=cp_ok, other=0.0)[None, :])
        dpost = tl.load(dpost_ptr + rows[:, None] * N + cp[None, :], mask=pmask, other=0.0)
        dz_post = dpost * 2.0 * sg * (1.0 - sg)
        tl.store(dz_ptr + rows[:, None] * M + N + cp[None, :], dz_post, mask=pmask)
        tl.store(dmix_ptr + rows[:, None] * M + N + cp[None, :], a_post * dz_post, mask=pmask)
        # comb = Sinkhorn(z): recompute the iterations from z (nothing stored in forward)
        cc = tl.arange(0, NP * NP)
        ci = cc // NP
        cj = cc % NP
        cc_ok = (ci < N) & (cj < N)
        cc_row = 2 * N + ci * N + cj
        cmask = rmask[:, None] & cc_ok[None, :]
        a_comb = tl.load(scale_ptr + 2)
        mix_comb = tl.load(mix_ptr + rows[:, None] * M + cc_row[None, :], mask=cmask, other=0.0)
        b_comb = tl.load(base_ptr + cc_row, mask=cc_ok, other=0.0)
        z = tl.reshape(a_comb * mix_comb + b_comb[None, :], [BT, NP, NP])
        valid = tl.reshape(cc_ok, [NP, NP])[None, :, :]
        dcomb = tl.load(dcomb_ptr + rows[:, None] * (N * N) + (ci * N + cj)[None, :], mask=cmask, other=0.0)
        dz = sinkhorn_bwd(z, valid, hc_eps, iters, tl.reshape(dcomb, [BT, NP, NP]))
        dz = tl.reshape(dz, [BT, NP * NP])
        tl.store(dz_ptr + rows[:, None] * M + cc_row[None, :], dz, mask=cmask)
        tl.store(dmix_ptr + rows[:, None] * M + cc_row[None, :], a_comb * dz, mask=cmask)


@triton.jit
def _coeff_bwd_dx_kernel(
    x_ptr,  # [T, N*D]
    dout_ptr,  # [T, D] (APPLY)
    pre_ptr,  # [T, N] (APPLY)
    dmix_ptr,  # [T, M]
    mix_ptr,  # [T, M]
    rstd_ptr,  # [T]
    fn_ptr,  # [M, N*D]
    dx_ptr,  # [T, N*D] out
    T,
    D,
    N: tl.constexpr,
    M: tl.constexpr,
    MP: tl.constexpr,
    APPLY: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = (pid * BT + tl.arange(0, BT)).to(tl.int64)
    rmask = rows < T
    K = N * D
    cm = tl.arange(0, MP)
    cm_ok = cm < M
    mmask = rmask[:, None] & cm_ok[None, :]
    dmix = tl.load(dmix_ptr + rows[:, None] * M + cm[None, :], mask=mmask, other=0.0)
    mix = tl.load(mix_ptr + rows[:, None] * M + cm[None, :], mask=mmask, other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
    # mix = rstd · (x @ fn.T): dX = rstd · dmix @ fn - X · rstd² · Σ_j dmix_j mix_j / (N·D)
    c = rstd * rstd * tl.sum(dmix * mix, 1) / K
    for i in tl.static_range(N):
        if APPLY:
            p_i = tl.load(pre_ptr + rows * N + i, mask=rmask, other=0.0)
        for d0 in range(0, D, BD):
            dd = d0 + tl.arange(0, BD)
            dmask = dd < D
            m2 = rmask[:, None] & dmask[None, :]
            kk = i * D + dd
            w = tl.load(
                fn_ptr + cm[:, None] * K + kk[None, :], mask=cm_ok[:, None] & dmask[None, :], other=0.0
            )
            g = tl.dot(dmix, w, input_precision=PREC)
            xi = tl.load(x_ptr + rows[:, None] * K + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            dx = rstd[:, None] * g - xi * c[:, None]
            if APPLY:
                # x_in = Σ_i pre_i X_i  ->  dX_i += pre_i · dx_in
                do = tl.load(dout_ptr + rows[:, None] * D + dd[None, :], mask=m2, other=0.0).to(tl.float32)
                dx += p_i[:, None] * do
            tl.store(dx_ptr + rows[:, None] * K + kk[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _dfn_kernel(
    x_ptr,  # [T, K]
    dmix_ptr,  # [T, M]
    rstd_ptr,  # [T]
    part_ptr,  # [SPLIT, M, K] fp32 out
    T,
    K,
    rows_per_split,
    M: tl.constexpr,
    MP: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    PREC: tl.constexpr,
):
    pid_k = tl.program_id(0)
    pid_s = tl.program_id(1)
    kk = pid_k * BK + tl.arange(0, BK)
    kmask = kk < K
    cm = tl.arange(0, MP)
    cm_ok = cm < M
    acc = tl.zeros([MP, BK], tl.float32)
    t_start = pid_s * rows_per_split
    for t0 in range(0, rows_per_split, BT):
        local = t0 + tl.arange(0, BT)
        rows = (t_start + local).to(tl.int64)
        rmask = (rows < T) & (local < rows_per_split)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        # dfn += (rstd · dmix)ᵀ @ X   (x̂ = rstd · X)
        dm = tl.load(
            dmix_ptr + rows[:, None] * M + cm[None, :], mask=rmask[:, None] & cm_ok[None, :], other=0.0
        )
        dm = dm * rstd[:, None]
        xt = tl.load(x_ptr + rows[:, None] * K + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(tl.trans(dm), xt.to(tl.float32), acc, input_precision=PREC)
    base = part_ptr + pid_s.to(tl.int64) * M * K
    tl.store(base + cm[:, None] * K + kk[None, :], acc, mask=cm_ok[:, None] & kmask[None, :])
