"""Fused Triton kernels: mHC coefficients (RMS + projection + sigmoid + Sinkhorn), optionally fused with ``mhc_pre``.

Forward (one program = ``BT`` tokens):
    pass 1 over the ``N·D`` stream values: ``Σx²`` and ONE small GEMM ``x @ fn.T`` per K-chunk against the whole
    ``[BK, M]`` fn tile (``[pre|post|comb]`` rows, padded to a power of two); then ``rstd``, the gates and Sinkhorn
    in registers; with ``APPLY`` a second pass over the same rows writes ``x_in = Σ_i pre_i · X_i``.
Dot precision (``_mm``, chosen on the host, see ``ops/precision.py``): ieee / tf32 / tf32x3 ``tl.dot`` on fp32
operands, or "bf16split": bf16 streams are exact in bf16, so the fp32 operand is split into three bf16 terms and
three bf16 tensor-core dots give fp32-accurate products with fp32 accumulation. Saved for backward: ``mix [T, M]`` and ``rstd [T]`` (M = 24 floats/token).
Backward:
    ``_coeff_bwd_kernel``  dpre (+ Σ_d dx_in·X_i when fused), gate derivatives, Sinkhorn recomputed -> ``dz``, ``dmix``
    ``_coeff_bwd_dx_dfn_kernel`` one read of X per (column chunk, token range) program for both
        ``dX = pre_i·dx_in + rstd·(dmix @ fn) - X·rstd²·(dmix·mix)/(N·D)`` and
        ``dfn = Σ_t (rstd·dmix)ᵀ X`` (partial sums per token range, reduced on the host)
The HyperHead (§6.4) is the same kernel with ``HAS_RES=False``: only the ``pre`` group, no Sinkhorn.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mhc.ops.sinkhorn_triton import sinkhorn_bwd, sinkhorn_prefix


@triton.jit
def _split_bf16(v):
    # v (fp32) = hi + mid + lo exactly up to ~2^-24·|v|: three bf16 terms of 8 significant bits each
    hi = v.to(tl.bfloat16)
    r = v - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _mm(a, b, acc, SPLIT: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr):
    """``acc + a @ b`` in fp32-grade precision.

    SPLIT = 0: both operands fp32 (or upcast), one ``tl.dot`` at ``PREC`` (ieee / tf32 / tf32x3).
    SPLIT = 1: ``a`` is bf16 (exact), ``b`` fp32 is split into three bf16 terms: three bf16 tensor-core dots whose
    products are exact, accumulated in fp32 (the accuracy of an fp32 dot at bf16 tensor-core speed).
    SPLIT = 2: the mirror image (``a`` fp32 split, ``b`` bf16).
    The interpreter has no bf16 dot: there the bf16 terms are upcast (same values, same math).
    """
    if SPLIT == 1:
        hi, mid, lo = _split_bf16(b)
        if INTERP:
            af = a.to(tl.float32)
            acc = tl.dot(af, lo.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(af, mid.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(af, hi.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, lo, acc)
            acc = tl.dot(a, mid, acc)
            acc = tl.dot(a, hi, acc)
    elif SPLIT == 2:
        hi, mid, lo = _split_bf16(a)
        if INTERP:
            bf = b.to(tl.float32)
            acc = tl.dot(lo.to(tl.float32), bf, acc, input_precision="ieee")
            acc = tl.dot(mid.to(tl.float32), bf, acc, input_precision="ieee")
            acc = tl.dot(hi.to(tl.float32), bf, acc, input_precision="ieee")
        else:
            acc = tl.dot(lo, b, acc)
            acc = tl.dot(mid, b, acc)
            acc = tl.dot(hi, b, acc)
    else:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PREC)
    return acc


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
    MP: tl.constexpr,
    HAS_RES: tl.constexpr,
    APPLY: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BD: tl.constexpr,
    SPLIT: tl.constexpr,
    PREC: tl.constexpr,
    INTERP: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = (pid * BT + tl.arange(0, BT)).to(tl.int64)
    rmask = rows < T
    K = N * D
    cm = tl.arange(0, MP)  # all M = (2+N)·N mix columns in one padded tile: one dot per K-chunk
    cm_ok = cm < M
    acc = tl.zeros([BT, MP], tl.float32)
    sumsq = tl.zeros([BT], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < K
        xt = tl.load(x_ptr + rows[:, None] * K + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        # mean(vec(X)^2) and mix = x @ fn.T (normalisation applied after the matmul)
        xf = xt.to(tl.float32)
        sumsq += tl.sum(xf * xf, 1)
        w = tl.load(fn_ptr + cm[None, :] * K + kk[:, None], mask=cm_ok[None, :] & kmask[:, None], other=0.0)
        acc = _mm(xt, w, acc, SPLIT, PREC, INTERP)  # [BT, MP]
    rstd = 1.0 / tl.sqrt(sumsq / K + norm_eps)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)
    # mix goes to memory (saved for backward) and is read back per group in the layouts the gates need
    tl.store(
        mix_ptr + rows[:, None] * M + cm[None, :], acc * rstd[:, None], mask=rmask[:, None] & cm_ok[None, :]
    )
    tl.debug_barrier()

    cp = tl.arange(0, PW)  # pre / post column
    cp_ok = cp < N
    pmask = rmask[:, None] & cp_ok[None, :]
    # pre = sigmoid(α_pre · mix[0:N] + base[0:N]) + eps
    mix_pre = tl.load(mix_ptr + rows[:, None] * M + cp[None, :], mask=pmask, other=0.0)
    a_pre = tl.load(scale_ptr)
    pre = tl.sigmoid(a_pre * mix_pre + tl.load(base_ptr + cp, mask=cp_ok, other=0.0)[None, :]) + hc_eps
    tl.store(pre_ptr + rows[:, None] * N + cp[None, :], pre, mask=pmask)
    if HAS_RES:
        # post = 2 · sigmoid(α_post · mix[N:2N] + base[N:2N])
        mix_post = tl.load(mix_ptr + rows[:, None] * M + N + cp[None, :], mask=pmask, other=0.0)
        a_post = tl.load(scale_ptr + 1)
        b_post = tl.load(base_ptr + N + cp, mask=cp_ok, other=0.0)
        post = 2.0 * tl.sigmoid(a_post * mix_post + b_post[None, :])
        tl.store(post_ptr + rows[:, None] * N + cp[None, :], post, mask=pmask)
        # comb = Sinkhorn(α_comb · mix[2N:] + base[2N:])
        cc = tl.arange(0, NP * NP)  # comb entry (i, j) on the padded NP x NP grid
        ci = cc // NP
        cj = cc % NP
        cc_ok = (ci < N) & (cj < N)
        cc_row = 2 * N + ci * N + cj  # row of fn/base for comb[i, j]
        cmask = rmask[:, None] & cc_ok[None, :]
        mix_comb = tl.load(mix_ptr + rows[:, None] * M + cc_row[None, :], mask=cmask, other=0.0)
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
            acc_o = tl.zeros([BT, BD], tl.float32)
            for i in tl.static_range(N):
                p_i = tl.sum(tl.where(cp[None, :] == i, pre, 0.0), 1)
                xi = tl.load(x_ptr + rows[:, None] * K + i * D + dd[None, :], mask=m2, other=0.0)
                acc_o += p_i[:, None] * xi.to(tl.float32)
            tl.store(out_ptr + rows[:, None] * D + dd[None, :], acc_o.to(out_ptr.dtype.element_ty), mask=m2)


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
    rstd_ptr,  # [T]
    c_ptr,  # [T] out: rstd² · Σ_j dmix_j · mix_j / (N·D)  (the RMS term of dX)
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
    dot_dm = tl.sum(a_pre * dz_pre * mix_pre, 1)
    if HAS_RES:
        # post = 2 σ(u)  ->  du = dpost · 2σ(1-σ)
        a_post = tl.load(scale_ptr + 1)
        mix_post = tl.load(mix_ptr + rows[:, None] * M + N + cp[None, :], mask=pmask, other=0.0)
        sg = tl.sigmoid(a_post * mix_post + tl.load(base_ptr + N + cp, mask=cp_ok, other=0.0)[None, :])
        dpost = tl.load(dpost_ptr + rows[:, None] * N + cp[None, :], mask=pmask, other=0.0)
        dz_post = dpost * 2.0 * sg * (1.0 - sg)
        tl.store(dz_ptr + rows[:, None] * M + N + cp[None, :], dz_post, mask=pmask)
        tl.store(dmix_ptr + rows[:, None] * M + N + cp[None, :], a_post * dz_post, mask=pmask)
        dot_dm += tl.sum(a_post * dz_post * mix_post, 1)
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
        dot_dm += tl.sum(tl.where(cmask, a_comb * dz * mix_comb, 0.0), 1)
    rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
    tl.store(c_ptr + rows, rstd * rstd * dot_dm / K, mask=rmask)


@triton.jit
def _coeff_bwd_dx_dfn_kernel(
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
    rows_per_split,
    N: tl.constexpr,
    M: tl.constexpr,
    MP: tl.constexpr,
    APPLY: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,  # 0 or 2 (see _mm)
    PREC: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One program = one K-chunk of columns x one token range: X is read once for both dX and dfn.

    mix = rstd · (x @ fn.T):  dX = rstd · dmix @ fn - X · c  (+ pre_i · dx_in),  dfn = Σ_t (rstd · dmix)ᵀ X.
    """
    pid_k = tl.program_id(0)
    pid_s = tl.program_id(1)
    K = N * D
    kk = pid_k * BK + tl.arange(0, BK)
    kmask = kk < K
    cm = tl.arange(0, MP)
    cm_ok = cm < M
    w = tl.load(
        fn_ptr + cm[:, None] * K + kk[None, :], mask=cm_ok[:, None] & kmask[None, :], other=0.0
    )  # [MP, BK]
    if APPLY:
        si = kk // D  # stream of each column
        dcol = kk - si * D
    acc = tl.zeros([MP, BK], tl.float32)
    t_start = pid_s * rows_per_split
    for t0 in range(0, rows_per_split, BT):
        local = t0 + tl.arange(0, BT)
        rows = (t_start + local).to(tl.int64)
        rmask = (rows < T) & (local < rows_per_split)
        m2 = rmask[:, None] & kmask[None, :]
        dmix = tl.load(
            dmix_ptr + rows[:, None] * M + cm[None, :], mask=rmask[:, None] & cm_ok[None, :], other=0.0
        )
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        c = tl.load(c_ptr + rows, mask=rmask, other=0.0)
        xt = tl.load(x_ptr + rows[:, None] * K + kk[None, :], mask=m2, other=0.0)  # [BT, BK]
        g = _mm(dmix, w, tl.zeros([BT, BK], tl.float32), 0, PREC, INTERP)
        dx = rstd[:, None] * g - xt.to(tl.float32) * c[:, None]
        if APPLY:
            # x_in = Σ_i pre_i X_i  ->  dX_i += pre_i · dx_in
            p = tl.load(pre_ptr + rows[:, None] * N + si[None, :], mask=m2, other=0.0)
            do = tl.load(dout_ptr + rows[:, None] * D + dcol[None, :], mask=m2, other=0.0)
            dx += p * do.to(tl.float32)
        tl.store(dx_ptr + rows[:, None] * K + kk[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m2)
        # dfn += (rstd · dmix)ᵀ @ X
        dm = tl.trans(dmix * rstd[:, None])  # [MP, BT]
        acc = _mm(dm, xt, acc, SPLIT, PREC, INTERP)
    base = part_ptr + pid_s.to(tl.int64) * M * K
    tl.store(base + cm[:, None] * K + kk[None, :], acc, mask=cm_ok[:, None] & kmask[None, :])
