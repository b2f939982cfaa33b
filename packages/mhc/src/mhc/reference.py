"""fp32 PyTorch references of every mHC op (dsv4-architecture.md §6; upstream-megatron-dsv4.md P2).

Shape legend: ``...`` leading token dims (``[T]`` or ``[S, B]``), ``N`` streams (``n_hc``), ``D`` hidden size,
``M = (2 + N) · N`` mixes. Streams are ``x [..., N, D]`` (stream ``i`` is ``x[..., i, :]``).

Coefficients (§6.2), per token, ``X ∈ R^{N×D}``::

    x̂    = vec(X) / sqrt(mean(vec(X)²) + norm_eps)             # RMS over all N·D values, no weight
    mix  = x̂ @ fn.T                                            # [M], rows [pre(N), post(N), comb(N·N)]
    pre  = sigmoid(scale[0] · mix[:N]     + base[:N])     + hc_eps
    post = 2 · sigmoid(scale[1] · mix[N:2N] + base[N:2N])
    comb = Sinkhorn((scale[2] · mix[2N:] + base[2N:]).view(N, N))

Sinkhorn (§6.3, the code's order)::

    S = softmax(M, dim=-1) + hc_eps                # row softmax first
    S = S / (S.sum(dim=-2) + hc_eps)               # column normalisation
    repeat t_max - 1 times: rows, then columns     # the last operation is always a column normalisation

Mixing (§6.4)::

    collapse (mhc_pre): x_in[..., :] = Σ_i pre[i] · X[..., i, :]
    mhc_post: X'[..., j, :]   = post[j] · F[..., :] + Σ_i comb[i, j] · X[..., i, :]     (X' = post ⊗ F + combᵀ X)

Every function takes ``upcast``: ``True`` (default) computes in fp32 (the reference); ``False`` runs the same math
in the input dtype, which is the "plain PyTorch in that dtype" yardstick of the testkit's tolerance rule
(float64 inputs are never downcast, so the same functions give a float64 truth).
"""

from __future__ import annotations

import torch


def _f(t: torch.Tensor, upcast: bool) -> torch.Tensor:
    # fp64 inputs stay fp64 (a float64 truth for fp32 kernel tests)
    if not upcast or t.dtype == torch.float64:
        return t
    return t.float()


def sinkhorn_ref(
    logits: torch.Tensor, iters: int = 20, eps: float = 1e-6, upcast: bool = True
) -> torch.Tensor:
    """Sinkhorn-Knopp in the DSv4 code's order. ``logits [..., N, N]`` (``M[i, j]``) -> ``comb [..., N, N]``.

    Row softmax + eps, column normalisation, then ``iters - 1`` rounds of (rows, columns). Columns sum to 1 (up to
    ``eps``); rows only approximately. Returns fp32 when ``upcast``.
    """
    s = torch.softmax(_f(logits, upcast), dim=-1) + eps
    s = s / (s.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        s = s / (s.sum(dim=-1, keepdim=True) + eps)
        s = s / (s.sum(dim=-2, keepdim=True) + eps)
    return s


def mhc_mix_ref(
    x: torch.Tensor, fn: torch.Tensor, norm_eps: float = 1e-6, upcast: bool = True
) -> torch.Tensor:
    """The dynamic mixes ``RMS(vec(X)) @ fn.T``. ``x [..., N, D]``, ``fn [M, N·D]`` -> ``mix [..., M]``."""
    xf = _f(x, upcast).flatten(-2)  # [..., N*D]
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm_eps)
    return (xf @ _f(fn, upcast).t()) * rstd


def _gate(mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """``sigmoid(scale · mix + base)``: the pre / post / HyperHead gates (scale a 0-dim slice, already cast)."""
    return torch.sigmoid(scale * mix + base)


def mhc_coefficients_ref(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    sinkhorn_iters: int = 20,
    norm_eps: float = 1e-6,
    hc_eps: float = 1e-6,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pre [..., N]``, ``post [..., N]``, ``comb [..., N, N]`` from ``x [..., N, D]`` (§6.2).

    ``fn [(2+N)·N, N·D]``, ``scale [3] = [α_pre, α_post, α_comb]``, ``base [(2+N)·N]``; rows ordered
    ``[pre, post, comb]`` with ``comb`` row-major (``2N + i·N + j`` is ``M[i, j]``).
    """
    n = x.shape[-2]
    mix = mhc_mix_ref(x, fn, norm_eps, upcast)
    scale_f, base_f = _f(scale, upcast), _f(base, upcast)
    pre = _gate(mix[..., :n], scale_f[0], base_f[:n]) + hc_eps
    post = 2.0 * _gate(mix[..., n : 2 * n], scale_f[1], base_f[n : 2 * n])
    logits = (scale_f[2] * mix[..., 2 * n :] + base_f[2 * n :]).unflatten(-1, (n, n))
    comb = sinkhorn_ref(logits, sinkhorn_iters, hc_eps, upcast)
    return pre, post, comb


def mhc_collapse_ref(x: torch.Tensor, pre: torch.Tensor, upcast: bool = True) -> torch.Tensor:
    """Weighted collapse ``x_in = Σ_i pre[i] · X[i]``. ``x [..., N, D]``, ``pre [..., N]`` -> ``[..., D]`` in x.dtype."""
    out = (_f(pre, upcast).unsqueeze(-1) * _f(x, upcast)).sum(-2)
    return out.to(x.dtype)


def mhc_pre_ref(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    sinkhorn_iters: int = 20,
    norm_eps: float = 1e-6,
    hc_eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spec's ``mhc_pre`` (§1.2): coefficients, then the collapse. Returns ``(x_in [..., D], post, comb)``.

    ``x_in`` is in ``out_dtype`` (default ``x.dtype``); ``post``/``comb`` are fp32 (when ``upcast``).
    """
    pre, post, comb = mhc_coefficients_ref(
        x, fn, scale, base, sinkhorn_iters=sinkhorn_iters, norm_eps=norm_eps, hc_eps=hc_eps, upcast=upcast
    )
    x_in = mhc_collapse_ref(x, pre, upcast)
    return x_in.to(out_dtype or x.dtype), post, comb


def mhc_post_ref(
    f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, upcast: bool = True
) -> torch.Tensor:
    """Residual mix ``X' = post ⊗ F + combᵀ X`` (contracts over comb's FIRST index).

    ``f [..., D]`` (the sub-layer output), ``x [..., N, D]``, ``post [..., N]``, ``comb [..., N, N]`` ->
    ``[..., N, D]`` in ``x.dtype``.
    """
    xf, ff = _f(x, upcast), _f(f, upcast)
    res = torch.einsum("...ij,...id->...jd", _f(comb, upcast), xf)  # combᵀ X
    out = _f(post, upcast).unsqueeze(-1) * ff.unsqueeze(-2) + res
    return out.to(x.dtype)


def expand_streams_ref(h: torch.Tensor, num_streams: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Stream expansion after the embedding: ``[..., D]`` -> ``[..., N, D]`` (N identical copies, in ``dtype``)."""
    out = h.unsqueeze(-2).expand(*h.shape[:-1], num_streams, h.shape[-1])
    return out.to(dtype or h.dtype).contiguous()


def hyper_head_weights_ref(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    norm_eps: float = 1e-6,
    hc_eps: float = 1e-6,
    upcast: bool = True,
) -> torch.Tensor:
    """HyperHead weights ``w = sigmoid(scale · RMS(vec X) @ fn.T + base) + hc_eps`` -> ``[..., N]`` (§6.4)."""
    mix = mhc_mix_ref(x, fn, norm_eps, upcast)
    return _gate(mix, _f(scale, upcast)[0], _f(base, upcast)) + hc_eps


def hyper_head_ref(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    norm_eps: float = 1e-6,
    hc_eps: float = 1e-6,
    upcast: bool = True,
) -> torch.Tensor:
    """Final learned collapse ``h = Σ_i w[i] · X[i]`` (no Sinkhorn). ``fn [N, N·D]``, ``scale [1]``, ``base [N]``.

    ``x [..., N, D]`` -> ``[..., D]`` in ``x.dtype``.
    """
    w = hyper_head_weights_ref(x, fn, scale, base, norm_eps=norm_eps, hc_eps=hc_eps, upcast=upcast)
    return mhc_collapse_ref(x, w, upcast)
