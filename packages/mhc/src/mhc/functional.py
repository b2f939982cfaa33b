"""Public, dispatching mHC ops (dsv4-architecture.md §6). Each has an fp32 reference twin in :mod:`mhc.reference`.

Shapes: streams ``x [..., N, D]`` (any leading token dims, e.g. ``[T]`` or ``[S, B]``), sub-layer output
``f [..., D]``, ``pre``/``post [..., N]`` and ``comb [..., N, N]`` in fp32. Parameters (``fn``, ``scale``,
``base``) are used in fp32 whatever their storage dtype. ``backend``: ``"auto"`` | ``"triton"`` | ``"reference"``
(env ``MHC_BACKEND`` overrides ``"auto"``).
"""

from __future__ import annotations

import torch

from dsv4_primitives.dispatch import resolve_backend
from mhc.ops.autograd import MHCCoefficientsFunction, MHCCollapseFunction, MHCPostFunction
from mhc.reference import (
    expand_streams_ref,
    hyper_head_ref,
    mhc_coefficients_ref,
    mhc_collapse_ref,
    mhc_post_ref,
    mhc_pre_ref,
)


def _check_streams(x: torch.Tensor, name: str = "x") -> tuple[int, int]:
    if x.dim() < 3:
        raise ValueError(
            f"{name} must be streams [..., N, D] with at least one token dim, got {tuple(x.shape)}"
        )
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name} must be floating point, got {x.dtype}")
    return x.shape[-2], x.shape[-1]


def _check_params(x: torch.Tensor, fn, scale, base, head: bool) -> None:
    n, d = x.shape[-2], x.shape[-1]
    m = n if head else (2 + n) * n
    want_scale = 1 if head else 3
    what = "HyperHead" if head else "mHC"
    if fn.shape != (m, n * d):
        raise ValueError(
            f"{what} fn must be [{m}, {n * d}] (rows {'[w]' if head else '[pre, post, comb]'} x N·D) for streams "
            f"N={n}, D={d}; got {tuple(fn.shape)}"
        )
    if scale.shape != (want_scale,):
        raise ValueError(f"{what} scale must have shape [{want_scale}], got {tuple(scale.shape)}")
    if base.shape != (m,):
        raise ValueError(f"{what} base must have shape [{m}], got {tuple(base.shape)}")


def _check_coefficient_inputs(x, fn, scale, base, sinkhorn_iters: int | None, head: bool = False) -> None:
    """Streams + parameters of the coefficient ops (mHC: with ``sinkhorn_iters``; HyperHead: ``head=True``)."""
    _check_streams(x)
    _check_params(x, fn, scale, base, head=head)
    if sinkhorn_iters is not None and sinkhorn_iters < 1:
        raise ValueError(f"sinkhorn_iters must be >= 1, got {sinkhorn_iters}")


def _tokens(x: torch.Tensor) -> torch.Tensor:
    n, d = x.shape[-2], x.shape[-1]
    return x.reshape(-1, n, d).contiguous()


def _coefficients_triton(x, fn, scale, base, iters, norm_eps, hc_eps, head, apply, out_dtype):
    lead = x.shape[:-2]
    n, d = x.shape[-2], x.shape[-1]
    pre, post, comb, out = MHCCoefficientsFunction.apply(
        _tokens(x), fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous(),
        int(iters), float(norm_eps), float(hc_eps), not head, apply, out_dtype,
    )  # fmt: skip
    pre = pre.reshape(*lead, n)
    if not head:
        post, comb = post.reshape(*lead, n), comb.reshape(*lead, n, n)
    if apply:
        out = out.reshape(*lead, d)
    return pre, post, comb, out


def mhc_coefficients(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    sinkhorn_iters: int = 20,
    norm_eps: float = 1e-6,
    hc_eps: float = 1e-6,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pre [..., N], post [..., N], comb [..., N, N])`` from the streams (§6.2, §6.3), fp32.

    ``fn [(2+N)·N, N·D]`` rows ``[pre, post, comb]``, ``scale [3]``, ``base [(2+N)·N]``. The Triton path fuses
    RMS, the projection, the gates and Sinkhorn into one kernel and recomputes Sinkhorn in backward.
    """
    _check_coefficient_inputs(x, fn, scale, base, sinkhorn_iters)
    if resolve_backend(backend, x, fn, op="mhc.mhc_coefficients") == "reference":
        return mhc_coefficients_ref(
            x, fn, scale, base, sinkhorn_iters=sinkhorn_iters, norm_eps=norm_eps, hc_eps=hc_eps
        )
    pre, post, comb, _ = _coefficients_triton(
        x, fn, scale, base, sinkhorn_iters, norm_eps, hc_eps, False, False, x.dtype
    )
    return pre, post, comb


def mhc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    sinkhorn_iters: int = 20,
    norm_eps: float = 1e-6,
    hc_eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spec's ``mhc_pre`` (§1.2): coefficients + weighted collapse in one fused kernel.

    Returns ``(x_in [..., D] in out_dtype (default x.dtype), post [..., N], comb [..., N, N])``.
    """
    _check_coefficient_inputs(x, fn, scale, base, sinkhorn_iters)
    out_dtype = out_dtype or x.dtype
    if resolve_backend(backend, x, fn, op="mhc.mhc_pre") == "reference":
        return mhc_pre_ref(
            x,
            fn,
            scale,
            base,
            sinkhorn_iters=sinkhorn_iters,
            norm_eps=norm_eps,
            hc_eps=hc_eps,
            out_dtype=out_dtype,
        )
    _, post, comb, x_in = _coefficients_triton(
        x, fn, scale, base, sinkhorn_iters, norm_eps, hc_eps, False, True, out_dtype
    )
    return x_in, post, comb


def mhc_collapse(
    x: torch.Tensor, pre: torch.Tensor, *, out_dtype: torch.dtype | None = None, backend: str = "auto"
) -> torch.Tensor:
    """Weighted collapse ``x_in = Σ_i pre[i] · X[i]`` with given weights. ``pre [..., N]`` -> ``[..., D]``."""
    n, d = _check_streams(x)
    if pre.shape != x.shape[:-1]:
        raise ValueError(
            f"pre must have shape {tuple(x.shape[:-1])} for streams {tuple(x.shape)}, got {tuple(pre.shape)}"
        )
    out_dtype = out_dtype or x.dtype
    if resolve_backend(backend, x, pre, op="mhc.mhc_collapse") == "reference":
        return mhc_collapse_ref(x, pre).to(out_dtype)

    out = MHCCollapseFunction.apply(_tokens(x), pre.float().reshape(-1, n).contiguous(), out_dtype)
    return out.reshape(*x.shape[:-2], d)


def mhc_post(
    f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *, backend: str = "auto"
) -> torch.Tensor:
    """Residual mix ``X' = post ⊗ F + combᵀ X`` (§6.4), output in ``x.dtype``.

    ``f [..., D]``, ``x [..., N, D]``, ``post [..., N]``, ``comb [..., N, N]`` (contracted over its FIRST index).
    """
    n, d = _check_streams(x)
    lead = x.shape[:-2]
    if f.shape != (*lead, d):
        raise ValueError(f"f must have shape {(*lead, d)} for streams {tuple(x.shape)}, got {tuple(f.shape)}")
    if post.shape != (*lead, n) or comb.shape != (*lead, n, n):
        raise ValueError(
            f"post/comb must be {(*lead, n)} / {(*lead, n, n)}, got {tuple(post.shape)} / {tuple(comb.shape)}"
        )
    if resolve_backend(backend, x, f, op="mhc.mhc_post") == "reference":
        return mhc_post_ref(f, x, post, comb)

    out = MHCPostFunction.apply(
        f.reshape(-1, d).contiguous(),
        _tokens(x),
        post.float().reshape(-1, n).contiguous(),
        comb.float().reshape(-1, n, n).contiguous(),
    )
    return out.reshape(x.shape)


def hyper_head(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    norm_eps: float = 1e-6,
    hc_eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Final learned collapse (HyperHead, §6.4): ``Σ_i w[i] X[i]``, ``w = sigmoid(scale·RMS(X)@fn.T + base) + eps``.

    ``fn [N, N·D]``, ``scale [1]``, ``base [N]``; ``x [..., N, D]`` -> ``[..., D]`` in ``out_dtype`` (default x.dtype).
    """
    _check_coefficient_inputs(x, fn, scale, base, None, head=True)
    out_dtype = out_dtype or x.dtype
    if resolve_backend(backend, x, fn, op="mhc.hyper_head") == "reference":
        return hyper_head_ref(x, fn, scale, base, norm_eps=norm_eps, hc_eps=hc_eps).to(out_dtype)
    _, _, _, out = _coefficients_triton(x, fn, scale, base, 1, norm_eps, hc_eps, True, True, out_dtype)
    return out


def expand_streams(h: torch.Tensor, num_streams: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Stream expansion after the embedding: ``h [..., D]`` -> ``[..., N, D]``, ``N`` identical copies in ``dtype``."""
    if num_streams < 1:
        raise ValueError(f"num_streams must be >= 1, got {num_streams}")
    if h.dim() < 1:
        raise ValueError("h must have a hidden dim")
    return expand_streams_ref(h, num_streams, dtype)
