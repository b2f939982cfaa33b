"""Fused Triton kernels of the vocab-parallel cross entropy over rows of logits (forward statistics, backward).

Row addressing: row ``r`` of the ``R`` rows starts at element ``(r // B) * stride_o + (r % B) * stride_i`` of the
logits buffer and its ``V`` vocabulary entries are contiguous (unit stride). ``B = 1`` covers any tensor viewable
as ``[R, V]`` (including a row stride wider than ``V``); ``B > 1`` covers an ``[S, B, V]`` tensor whose ``S`` and
``B`` dims cannot be merged (e.g. ``[B, S, V].transpose(0, 1)``). Offsets are int64.

Forward (``ce_fwd_stats_kernel``): one program owns ``BLOCK_R`` rows and streams their vocabulary in
``BLOCK_V``-wide chunks once, keeping per row in fp32 registers

    m = running max,   s = sum_j exp(z_j - m)   (rescaled by exp(m_old - m_new) when the max grows)
    zsum = sum_j z_j                             (only with label smoothing, ``NEED_SUM``)

and loads the target logit ``z[t - vocab_start]`` directly (0 when the target is outside the shard). It writes
``m, s, z_t[, zsum]`` (fp32, 4 bytes per row each); the caller combines them across tensor-parallel ranks.

Backward (``ce_bwd_kernel``): a 2-D grid over (row blocks, vocabulary chunks); each program reads its logits tile
once and writes ``g * (exp(z - lse) - target_coef * onehot - uniform)`` in the output dtype. The output may be the
logits buffer itself (in place): every element is read before the same program overwrites it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ce_fwd_stats_kernel(
    x_ptr,
    tgt_ptr,
    m_ptr,
    s_ptr,
    zt_ptr,
    zsum_ptr,
    R,
    V,
    B,
    stride_o,
    stride_i,
    vocab_start,
    NEED_SUM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    rmask = rows < R
    base = (rows // B) * stride_o + (rows % B) * stride_i  # [BR] int64 row starts
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_R], dtype=tl.float32)
    zsum = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in range(0, V, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)  # [BV]
        msk = rmask[:, None] & (cols < V)[None, :]
        z = tl.load(x_ptr + base[:, None] + cols[None, :], mask=msk, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=1))  # [BR]
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # finite shift (rows past R, all -inf rows)
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(z - m_ref[:, None]), axis=1)
        m = m_new
        if NEED_SUM:
            zsum += tl.sum(tl.where(msk, z, 0.0), axis=1)
    t = tl.load(tgt_ptr + rows, mask=rmask, other=0).to(tl.int64) - vocab_start  # [BR] shard-local target
    own = rmask & (t >= 0) & (t < V)
    zt = tl.load(x_ptr + base + tl.where(own, t, 0), mask=own, other=0.0).to(tl.float32)
    tl.store(m_ptr + rows, m, mask=rmask)
    tl.store(s_ptr + rows, s, mask=rmask)
    tl.store(zt_ptr + rows, zt, mask=rmask)
    if NEED_SUM:
        tl.store(zsum_ptr + rows, zsum, mask=rmask)


@triton.jit
def ce_bwd_kernel(
    x_ptr,
    out_ptr,
    tgt_ptr,
    lse_ptr,
    g_ptr,
    R,
    V,
    B,
    stride_xo,
    stride_xi,
    stride_oo,
    stride_oi,
    vocab_start,
    target_coef,
    uniform,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # [BV]
    rmask = rows < R
    msk = rmask[:, None] & (cols < V)[None, :]
    ob, ib = rows // B, rows % B
    xoff = (ob * stride_xo + ib * stride_xi)[:, None] + cols[None, :]  # [BR, BV]
    ooff = (ob * stride_oo + ib * stride_oi)[:, None] + cols[None, :]
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)  # [BR] fp32
    g = tl.load(g_ptr + rows, mask=rmask, other=0.0)  # [BR] fp32
    t = tl.load(tgt_ptr + rows, mask=rmask, other=0).to(tl.int64) - vocab_start  # outside [0, V): no one-hot
    z = tl.load(x_ptr + xoff, mask=msk, other=float("-inf")).to(tl.float32)
    p = tl.exp(z - lse[:, None])  # softmax over the whole (all-rank) vocabulary
    onehot = cols[None, :].to(tl.int64) == t[:, None]
    dz = (p - uniform - tl.where(onehot, target_coef, 0.0)) * g[:, None]
    tl.store(out_ptr + ooff, dz.to(out_ptr.dtype.element_ty), mask=msk)
