"""Host wrappers (block sizes, allocation, grids) and ``autograd.Function`` bindings of the mHC Triton kernels.

Inputs are flattened to tokens: streams ``x [T, N, D]`` (contiguous), sub-layer output ``f [T, D]``.
Coefficients ``pre/post [T, N]``, ``comb [T, N, N]`` are fp32; the parameters ``fn [M, N·D]``, ``scale``,
``base [M]`` are fp32 (callers upcast).
"""

from __future__ import annotations

import torch
import triton

from mhc.ops.coefficients_bwd_triton import _coeff_bwd_dx_dfn_stream_kernel
from mhc.ops.coefficients_splitk_triton import _coeff_fwd_finish_kernel, _coeff_fwd_partial_kernel
from mhc.ops.coefficients_triton import _coeff_bwd_dx_dfn_kernel, _coeff_bwd_kernel, _coeff_fwd_kernel
from mhc.ops.launch import (
    coeff_bwd_streams_cfg,
    coeff_finish_cfg,
    coeff_splitk_cfg,
    env_cfg,
    interpreting,
    kernel_set,
    post_bwd_cfg,
    pow2,
    split_k,
)
from mhc.ops.mixing_triton import (
    _collapse_dpre_kernel,
    _post_bwd_kernel,
    _post_fwd_kernel,
    _pre_bwd_kernel,
    _pre_fwd_kernel,
)
from mhc.ops.precision import dot_plan

_interpreting = interpreting
_pow2 = pow2


def _pads(n: int) -> tuple[int, int]:
    """(NP, PW): comb grid side (NP·NP >= 16 for tl.dot) and pre/post width (>= 16)."""
    return max(4, _pow2(n)), max(16, _pow2(n))


# ---------------------------------------------------------------- coefficients (+ fused collapse)


def coefficients_fwd(x, fn, scale, base, iters, norm_eps, hc_eps, has_res, apply, out_dtype):
    """Launch the coefficient kernels. Returns ``pre, post, comb, x_in, mix, rstd``."""
    t, n, d = x.shape
    m = fn.shape[0]
    dev = x.device
    pre = torch.empty(t, n, device=dev, dtype=torch.float32)
    post = torch.empty(t, n, device=dev, dtype=torch.float32) if has_res else pre.new_empty(0)
    comb = torch.empty(t, n, n, device=dev, dtype=torch.float32) if has_res else pre.new_empty(0)
    out = torch.empty(t, d, device=dev, dtype=out_dtype) if apply else x.new_empty(0)
    mix = torch.empty(t, m, device=dev, dtype=torch.float32)
    rstd = torch.empty(t, device=dev, dtype=torch.float32)
    if t == 0:
        return pre, post, comb, out, mix, rstd
    outs = (pre, post, comb, out, mix, rstd)
    args = (x, fn, scale, base, iters, norm_eps, hc_eps, has_res, apply)
    if kernel_set() == "legacy":
        _coefficients_fwd_fused(*args, outs)
    else:
        _coefficients_fwd_splitk(*args, outs)
    return outs


def _coefficients_fwd_splitk(x, fn, scale, base, iters, norm_eps, hc_eps, has_res, apply, outs):
    """Split-K partials over N·D, then one finishing kernel (gates, Sinkhorn, collapse)."""
    pre, post, comb, out, mix, rstd = outs
    t, n, d = x.shape
    m, k = fn.shape
    mp = max(16, _pow2(m))
    interp = _interpreting()
    plan = dot_plan(x.dtype, interp)
    bt, bk, want, warps, stages = coeff_splitk_cfg(t, k, x.device, x.element_size())
    k_per_split, n_split = split_k(k, bk, want)
    part = torch.empty(n_split, t, mp, device=x.device, dtype=torch.float32)
    ssq = torch.empty(n_split, t, device=x.device, dtype=torch.float32)
    _coeff_fwd_partial_kernel[(triton.cdiv(t, bt), n_split)](
        x, fn, part, ssq, t, k, k_per_split,
        M=m, MP=mp, BT=bt, BK=bk, SPLIT=plan.fwd_split, PREC=plan.prec, INTERP=interp,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    fbt, fbd = coeff_finish_cfg(d, apply)
    _coeff_fwd_finish_kernel[(triton.cdiv(t, fbt), triton.cdiv(d, fbd) if apply else 1)](
        part, ssq, x, scale, base, pre, post, comb, out, mix, rstd,
        t, d, n_split, float(norm_eps), float(hc_eps), int(iters),
        N=n, NP=max(2, _pow2(n)), M=m, MP=mp, HAS_RES=has_res, APPLY=apply, BT=fbt, BD=fbd, num_warps=4,
    )  # fmt: skip


def _coefficients_fwd_fused(x, fn, scale, base, iters, norm_eps, hc_eps, has_res, apply, outs):
    """The 0.1.0 launch: one fused kernel per token block (``MHC_KERNELS=legacy``)."""
    pre, post, comb, out, mix, rstd = outs
    t, n, d = x.shape
    m = fn.shape[0]
    np_, pw = _pads(n)
    interp = _interpreting()
    plan = dot_plan(x.dtype, interp)
    if interp:
        bt, bk, bd, warps, stages = 16, min(_pow2(n * d), 1024), min(_pow2(d), 512), 4, 1
    else:
        # BT=64 rows per program: the fn tile [BK, 32] fp32 re-read per K-chunk costs 0.75x the streams' bytes
        bt, bk, bd, warps, stages = env_cfg("COEFF_FWD", (64, 64, 256, 4, 3))
    _coeff_fwd_kernel[(triton.cdiv(t, bt),)](
        x, fn, scale, base, pre, post, comb, out, mix, rstd,
        t, d, float(norm_eps), float(hc_eps), int(iters),
        N=n, NP=np_, PW=pw, M=m, MP=max(16, _pow2(m)), HAS_RES=has_res, APPLY=apply,
        BT=bt, BK=bk, BD=bd, SPLIT=plan.fwd_split, PREC=plan.prec, INTERP=interp,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip


def coefficients_bwd(
    x, fn, scale, base, mix, rstd, pre, dpre, dpost, dcomb, dout, iters, hc_eps, has_res, apply
):
    """Gradients ``dx [T, N, D]``, ``dfn [M, N·D]``, ``dscale``, ``dbase [M]`` of the coefficient op."""
    t, n, _ = x.shape
    m = fn.shape[0]
    dev = x.device
    if t == 0:
        return torch.zeros_like(x), torch.zeros_like(fn), torch.zeros_like(scale), torch.zeros_like(base)
    f32 = torch.float32
    if has_res:
        dpost = torch.zeros(t, n, device=dev, dtype=f32) if dpost is None else dpost.contiguous().float()
        dcomb = torch.zeros(t, n, n, device=dev, dtype=f32) if dcomb is None else dcomb.contiguous().float()
    else:
        dpost = dcomb = mix.new_empty(0)
    has_dpre = dpre is not None
    dpre = dpre.contiguous().float() if has_dpre else mix.new_empty(0)
    apply = apply and dout is not None
    dout = dout.contiguous() if apply else mix.new_empty(0)
    dz = torch.empty(t, m, device=dev, dtype=f32)
    dmix = torch.empty(t, m, device=dev, dtype=f32)
    c = torch.empty(t, device=dev, dtype=f32)
    dx = torch.empty_like(x)
    args = (
        x,
        fn,
        scale,
        base,
        mix,
        rstd,
        pre,
        dpre,
        dpost,
        dcomb,
        dout,
        iters,
        hc_eps,
        has_res,
        apply,
        has_dpre,
    )
    if kernel_set() == "legacy" or not streams_bwd_wins(t, has_res, apply):
        dfn = _coefficients_bwd_fused(*args, dz, dmix, c, dx)
    else:
        dfn = _coefficients_bwd_streams(*args, dz, dmix, c, dx)
    # the gate pre-activation is u = α_g · mix + base:  dbase = Σ_t du,  dα_g = Σ_t Σ_{c in g} du · mix
    dbase = dz.sum(0)
    prod = dz * mix
    if has_res:
        dscale = torch.stack([prod[:, :n].sum(), prod[:, n : 2 * n].sum(), prod[:, 2 * n :].sum()])
    else:
        dscale = prod.sum().reshape(1)
    return dx, dfn, dscale, dbase


def streams_bwd_wins(t: int, has_res: bool, apply: bool) -> bool:
    """Backward launch of the ``tuned`` set, chosen per mode: the stream-aligned dX/dfn pass only for the layer
    op with the fused collapse (``pre``: ``has_res`` and ``apply``) up to T = 4096 tokens; the fused 0.1.0 pass for
    coefficient-only calls, the HyperHead (no residual mixing) and longer sequences. H200, n = 4, d = 4096, fp32
    streams (``benchmarks/bench_mhc_kernels.py``): pre T = 4096 0.591 vs 0.896 ms; coeff 0.886 vs 0.649; head 0.867
    vs 0.663; pre T = 8192 1.481 vs 1.150."""
    return has_res and apply and t <= 4096


def _coefficients_bwd_streams(
    x, fn, scale, base, mix, rstd, pre, dpre, dpost, dcomb, dout, iters, hc_eps, has_res, apply, has_dpre,
    dz, dmix, c, dx,
):  # fmt: skip
    """Tuned backward: dpre pass (streaming), gates + Sinkhorn backward, stream-aligned dX/dfn pass."""
    t, n, d = x.shape
    m, k = fn.shape
    np_, pw = _pads(n)
    interp = _interpreting()
    if apply:
        # dpre += Σ_d dx_in · X_i : a streaming reduction with many small programs (2 rows x 512 columns)
        bt, bd = (4, min(_pow2(d), 64)) if interp else (2, 512)
        dpre_all = torch.empty(t, n, device=x.device, dtype=torch.float32)
        _collapse_dpre_kernel[(triton.cdiv(t, bt),)](
            x, dout, dpre, dpre_all, t, d, N=n, NP=_pow2(n), HAS_DPRE=has_dpre, BT=bt, BD=bd, num_warps=4
        )
        dpre, has_dpre = dpre_all, True
    # gates + Sinkhorn backward only (no X): 8 tokens per program, one [N, N] entry per thread
    bt = 16 if interp else 8
    _coeff_bwd_kernel[(triton.cdiv(t, bt),)](
        x, dout, pre, dpre, dpost, dcomb, mix, scale, base, dz, dmix, rstd, c,
        t, d, float(hc_eps), int(iters),
        N=n, NP=np_, PW=pw, M=m, HAS_RES=has_res, APPLY=False, HAS_DPRE=has_dpre,
        BT=bt, BD=16, num_warps=4,
    )  # fmt: skip
    # dX and dfn in one pass over X: programs = (stream-aligned column chunk, token range)
    plan = dot_plan(x.dtype, interp)
    bt, bk, warps, stages, rows_per_split, split = coeff_bwd_streams_cfg(t, n, d, x.device)
    mp = max(16, _pow2(m))
    part = torch.empty(split, m, k, device=x.device, dtype=torch.float32)
    _coeff_bwd_dx_dfn_stream_kernel[(n * triton.cdiv(d, bk), split)](
        x, dout, pre, dmix, c, rstd, fn, dx, part, t, d, rows_per_split,
        N=n, M=m, MP=mp, APPLY=apply, BT=bt, BK=bk, SPLIT=plan.dfn_split // 2, PREC=plan.prec, INTERP=interp,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return part.sum(0) if split > 1 else part[0]


def _coefficients_bwd_fused(
    x, fn, scale, base, mix, rstd, pre, dpre, dpost, dcomb, dout, iters, hc_eps, has_res, apply, has_dpre,
    dz, dmix, c, dx,
):  # fmt: skip
    """The 0.1.0 backward launches (``MHC_KERNELS=legacy``, and ``tuned`` where :func:`streams_bwd_wins` is False)."""
    t, n, d = x.shape
    m, k = fn.shape
    np_, pw = _pads(n)
    mp = max(16, _pow2(m))
    interp = _interpreting()
    plan = dot_plan(x.dtype, interp)
    bt, bd = (16, min(_pow2(d), 512)) if interp else (16, 256)
    _coeff_bwd_kernel[(triton.cdiv(t, bt),)](
        x, dout, pre, dpre, dpost, dcomb, mix, scale, base, dz, dmix, rstd, c,
        t, d, float(hc_eps), int(iters),
        N=n, NP=np_, PW=pw, M=m, HAS_RES=has_res, APPLY=apply, HAS_DPRE=has_dpre,
        BT=bt, BD=bd, num_warps=4,
    )  # fmt: skip
    # dX and dfn in one pass over X: programs = (column chunk, token range); dfn partials reduced here
    if interp:
        bt, bk, split, warps, stages = 16, min(_pow2(k), 1024), 1, 4, 1
    else:
        bt, bk, warps, stages = env_cfg("COEFF_BWD", (32, 128, 4, 3))
        split = max(1, min(triton.cdiv(t, 512), triton.cdiv(4 * 132, triton.cdiv(k, bk))))
    rows_per_split = triton.cdiv(triton.cdiv(t, split), bt) * bt
    split = triton.cdiv(t, rows_per_split)
    part = torch.empty(split, m, k, device=x.device, dtype=torch.float32)
    _coeff_bwd_dx_dfn_kernel[(triton.cdiv(k, bk), split)](
        x, dout, pre, dmix, c, rstd, fn, dx, part, t, d, rows_per_split,
        N=n, M=m, MP=mp, APPLY=apply, BT=bt, BK=bk, SPLIT=plan.dfn_split, PREC=plan.prec, INTERP=interp,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return part.sum(0) if split > 1 else part[0]


class MHCCoefficientsFunction(torch.autograd.Function):
    """Fused coefficients (and optionally the ``pre`` collapse); Sinkhorn is recomputed in backward."""

    @staticmethod
    def forward(ctx, x, fn, scale, base, iters, norm_eps, hc_eps, has_res, apply, out_dtype):
        pre, post, comb, out, mix, rstd = coefficients_fwd(
            x, fn, scale, base, iters, norm_eps, hc_eps, has_res, apply, out_dtype
        )
        ctx.save_for_backward(x, fn, scale, base, mix, rstd, pre)
        ctx.cfg = (iters, hc_eps, has_res, apply)
        if not has_res:
            ctx.mark_non_differentiable(post, comb)
        if not apply:
            ctx.mark_non_differentiable(out)
        return pre, post, comb, out

    @staticmethod
    def backward(ctx, dpre, dpost, dcomb, dout):
        x, fn, scale, base, mix, rstd, pre = ctx.saved_tensors
        iters, hc_eps, has_res, apply = ctx.cfg
        dx, dfn, dscale, dbase = coefficients_bwd(
            x, fn, scale, base, mix, rstd, pre, dpre, dpost, dcomb, dout, iters, hc_eps, has_res, apply
        )
        return dx, dfn, dscale, dbase, None, None, None, None, None, None


# ---------------------------------------------------------------- collapse (pre given) and post


def _mix_blocks(d: int) -> tuple[int, int]:
    return (16, min(_pow2(d), 512)) if _interpreting() else (8, 128)


class MHCCollapseFunction(torch.autograd.Function):
    """``x_in = Σ_i pre_i · X_i`` with a given ``pre``."""

    @staticmethod
    def forward(ctx, x, pre, out_dtype):
        t, n, d = x.shape
        np_ = _pow2(n)
        out = torch.empty(t, d, device=x.device, dtype=out_dtype)
        if t > 0:
            bt, bd = _mix_blocks(d)
            _pre_fwd_kernel[(triton.cdiv(t, bt), triton.cdiv(d, bd))](
                x, pre, out, t, d, N=n, NP=np_, BT=bt, BD=bd
            )
        ctx.save_for_backward(x, pre)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, pre = ctx.saved_tensors
        t, n, d = x.shape
        dx = torch.empty_like(x)
        dpre = torch.empty(t, n, device=x.device, dtype=torch.float32)
        if t > 0:
            bt, bd = _mix_blocks(d)
            _pre_bwd_kernel[(triton.cdiv(t, bt),)](
                x, pre, dout.contiguous(), dx, dpre, t, d, N=n, NP=_pow2(n), BT=bt, BD=bd
            )
        return dx, dpre, None


class MHCPostFunction(torch.autograd.Function):
    """``X' = post ⊗ F + combᵀ X``."""

    @staticmethod
    def forward(ctx, f, x, post, comb):
        t, n, d = x.shape
        out = torch.empty_like(x)
        if t > 0:
            bt, bd = _mix_blocks(d)
            _post_fwd_kernel[(triton.cdiv(t, bt), triton.cdiv(d, bd))](
                f, x, post, comb, out, t, d, N=n, NP=_pow2(n), BT=bt, BD=bd
            )
        ctx.save_for_backward(f, x, post, comb)
        return out

    @staticmethod
    def backward(ctx, dout):
        f, x, post, comb = ctx.saved_tensors
        t, n, d = x.shape
        df = torch.empty_like(f)
        dx = torch.empty_like(x)
        if t == 0:
            return df, dx, post.new_zeros(t, n), comb.new_zeros(t, n, n)
        bt, bd, dsplit, warps = post_bwd_cfg(t, d, x.device)
        d_per_split, dsplit = split_k(d, bd, dsplit)
        dpost = torch.empty(dsplit, t, n, device=x.device, dtype=torch.float32)
        dcomb = torch.empty(dsplit, t, n, n, device=x.device, dtype=torch.float32)
        _post_bwd_kernel[(triton.cdiv(t, bt), dsplit)](
            f, x, post, comb, dout.contiguous(), df, dx, dpost, dcomb, t, d, d_per_split,
            N=n, NP=_pow2(n), BT=bt, BD=bd, num_warps=warps,
        )  # fmt: skip
        if dsplit > 1:
            return df, dx, dpost.sum(0), dcomb.sum(0)
        return df, dx, dpost[0], dcomb[0]
