"""Sinkhorn-Knopp as ``@triton.jit`` helpers on a block of tokens, forward and recompute-in-backward.

Tensors are ``[BT, NP, NP]`` (NP = stream count padded to a power of two); ``valid`` masks the real ``N×N``
entries, padded entries are kept at exactly 0. The half-steps, in the reference's order (reference.sinkhorn_ref):

    step 0:            S = softmax(z, dim=-1) + eps          (row softmax first)
    step 1, 3, 5, ...: S = S / (S.sum(dim=-2) + eps)         (columns)
    step 2, 4, ...:    S = S / (S.sum(dim=-1) + eps)         (rows)

``iters`` Sinkhorn iterations are ``2·iters`` half-steps, the last one a column normalisation. The backward keeps
no iterate: for each half-step (last to first) it recomputes that step's input from ``z``. That is O(iters²) tiny
[N, N] operations per token and no memory, instead of storing ``2·iters`` copies of ``S``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _sk_softmax(z, valid):
    # row softmax over the valid columns; padded rows come out as 0
    zm = tl.where(valid, z, -1e30)
    m = tl.max(zm, 2)
    p = tl.exp(zm - m[:, :, None])
    p = p / tl.sum(p, 2)[:, :, None]
    return tl.where(valid, p, 0.0)


@triton.jit
def _sk_col(s, valid, eps):
    # S = S / (S.sum(dim=-2, keepdim) + eps)
    den = tl.sum(s, 1)[:, None, :] + eps
    return tl.where(valid, s / den, 0.0)


@triton.jit
def _sk_row(s, valid, eps):
    # S = S / (S.sum(dim=-1, keepdim) + eps)
    den = tl.sum(s, 2)[:, :, None] + eps
    return tl.where(valid, s / den, 0.0)


@triton.jit
def sinkhorn_prefix(z, valid, eps, nsteps):
    """``S`` after half-steps ``0 .. nsteps-1`` (``nsteps >= 1``); ``nsteps = 2·iters`` is the full forward."""
    # S = softmax(M, dim=-1) + eps
    s = tl.where(valid, _sk_softmax(z, valid) + eps, 0.0)
    for _ in range(0, (nsteps - 1) // 2):
        s = _sk_col(s, valid, eps)
        s = _sk_row(s, valid, eps)
    if (nsteps - 1) % 2 == 1:
        s = _sk_col(s, valid, eps)
    return s


@triton.jit
def _sk_col_bwd(s_in, ds_out, valid, eps):
    # S' = S / D,  D_j = Σ_i S_ij + eps  ->  dS_ij = dS'_ij / D_j - Σ_i' dS'_i'j S_i'j / D_j²
    den = tl.sum(s_in, 1)[:, None, :] + eps
    g = tl.sum(ds_out * s_in, 1)[:, None, :] / (den * den)
    return tl.where(valid, ds_out / den - g, 0.0)


@triton.jit
def _sk_row_bwd(s_in, ds_out, valid, eps):
    den = tl.sum(s_in, 2)[:, :, None] + eps
    g = tl.sum(ds_out * s_in, 2)[:, :, None] / (den * den)
    return tl.where(valid, ds_out / den - g, 0.0)


@triton.jit
def sinkhorn_bwd(z, valid, eps, iters, ds):
    """Gradient w.r.t. the logits ``z`` given ``ds = dL/dcomb``; every step's input is recomputed from ``z``."""
    nsteps = 2 * iters
    for kk in range(0, nsteps - 1):
        k = nsteps - 1 - kk
        s_in = sinkhorn_prefix(z, valid, eps, k)
        if k % 2 == 1:
            ds = _sk_col_bwd(s_in, ds, valid, eps)
        else:
            ds = _sk_row_bwd(s_in, ds, valid, eps)
    # step 0: S = P + eps, P = softmax(z)  ->  dz = P ⊙ (dP - Σ_j dP P)
    p = _sk_softmax(z, valid)
    dp = tl.where(valid, ds, 0.0)
    dz = p * (dp - tl.sum(dp * p, 2)[:, :, None])
    return tl.where(valid, dz, 0.0)
