"""Fused Triton index scores at given entries (forward) and their gradient (backward), spec §4.2 / §5.2.

Per query row ``t`` with slots ``j`` (``e = idx[t, j]`` a global row of ``k_idx``, ``-1`` = empty slot)::

    S[t, j, h]   = <q[t, h], k[e]>
    score[t, j]  = sum_h w[t, h] * relu(S[t, j, h])                      (-inf where e = -1)
    dS[t, j, h]  = g[t, j] * w[t, h] * [S[t, j, h] > 0]                   (g = 0 where e = -1)
    dw[t, h]     = sum_j g[t, j] * relu(S[t, j, h])
    dq[t, h, :]  = sum_j dS[t, j, h] * k[e]
    dk[e, :]    += sum_h dS[t, j, h] * q[t, h, :]                         (fp32 atomics, or stored per pair and reduced)

Schedule: one program per (query row, block of BLOCK_H heads). The row's heads sit on the MMA M dimension and share
each gathered ``[BLOCK_J, DI]`` key tile (gathered once per head block): the score GEMM ``q k^T`` is
``[BLOCK_H, DI] x [DI, BLOCK_J]``; the backward adds ``dq += dS k`` (``[BLOCK_H, BLOCK_J] x [BLOCK_J, DI]``, fp32 in
registers for the whole row) and ``dk_tile = dS^T q`` (``[BLOCK_J, BLOCK_H] x [BLOCK_H, DI]``), added into an fp32
``[Tc, DI]`` buffer with relaxed atomics (deterministic mode: the key-major pass of :mod:`.scores_at_keymajor`, the
default, or, with ``scores_at_config.DETERMINISTIC_DK = "inverted"``, stored per (row, slot) pair and summed per key
over an inverted index, :mod:`csa_kernels._inverted`, rows in chunks that fit ``scores_at_config.PAIR_BYTES``). Each program first scans its index row for the last valid slot and loops
only up to it (top-k rows keep their ``-1`` slots at the end: early tokens cost only their valid work). Nothing of
size ``[T, K, DI]`` or ``[T, HI, K]`` is ever formed.

dtype policy: bf16 / fp16 operands go to the tensor cores as they are (``dS`` is rounded to the operand dtype
before the two gradient GEMMs, as in flash-attention), fp32 inputs use exact "ieee" dots, fp64 inputs are computed in
fp32; accumulation is fp32 everywhere; under ``TRITON_INTERPRET=1`` operands are upcast to fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from csa_kernels._inverted import chunk_index, gather_reduce, sort_pairs
from csa_kernels._triton_utils import check_triton_device, interpreting, next_pow2, sm_count
from csa_kernels.ops.indexer import scores_at_config
from csa_kernels.ops.indexer.scores_at_keymajor import scores_at_dk_keymajor


@triton.jit
def _gather_key_tile(K, IDX_ROW, offs_j, KS, offs_d, md, stride_kc, UPCAST: tl.constexpr):
    """The key rows ``K[idx[j]]`` of slots ``offs_j`` of one index row: ``(rows int64, valid, k [BLOCK_J,
    BLOCK_DI])`` with zero rows at ``-1`` slots (fp32 when ``UPCAST``)."""
    idx = tl.load(IDX_ROW + offs_j, mask=offs_j < KS, other=-1)
    valid = idx >= 0
    rows = tl.where(valid, idx, 0).to(tl.int64)
    k = tl.load(K + rows[:, None] * stride_kc + offs_d[None, :], mask=valid[:, None] & md[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    return rows, valid, k


@triton.jit
def _row_end(IDX_ROW, KS, BLOCK: tl.constexpr):
    """1 + the last slot of the index row holding a valid (>= 0) entry; 0 for a row of -1."""
    end = tl.zeros([], dtype=tl.int32)
    for j0 in range(0, KS, BLOCK):
        offs = j0 + tl.arange(0, BLOCK)
        idx = tl.load(IDX_ROW + offs, mask=offs < KS, other=-1)
        end = tl.maximum(end, tl.max(tl.where(idx >= 0, offs + 1, 0), 0))
    return end


@triton.jit
def _scores_at_fwd_kernel(
    Q,
    K,
    W,
    IDX,
    OUT,
    stride_qt,
    stride_qh,
    stride_kc,
    stride_wt,
    stride_it,
    stride_ot,
    HI,
    KS,
    DI: tl.constexpr,
    BLOCK_DI: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_J: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """score[t, j] for one query row (all head blocks looped inside; OUT is pre-filled with -inf)."""
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_DI)
    md = offs_d < DI
    end = _row_end(IDX + t * stride_it, KS, 256)
    for j0 in range(0, end, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        _, valid, k = _gather_key_tile(K, IDX + t * stride_it, offs_j, KS, offs_d, md, stride_kc, UPCAST)
        acc = tl.zeros([BLOCK_J], dtype=tl.float32)
        for h0 in range(0, HI, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mh = offs_h < HI
            q = tl.load(
                Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=mh[:, None] & md[None, :],
                other=0.0,
            )  # [BLOCK_H, BLOCK_DI]
            if UPCAST:
                q = q.to(tl.float32)
            w = tl.load(W + t * stride_wt + offs_h, mask=mh, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_H, BLOCK_J]
            acc += tl.sum(w[:, None] * tl.maximum(s, 0.0), 0)
        tl.store(OUT + t * stride_ot + offs_j, tl.where(valid, acc, -float("inf")), mask=offs_j < KS)


@triton.jit
def _scores_at_bwd_kernel(
    Q,
    K,
    W,
    IDX,
    G,
    DQ,
    DK,
    DW,
    stride_qt,
    stride_qh,
    stride_kc,
    stride_wt,
    stride_it,
    stride_gt,
    stride_dqt,
    stride_dqh,
    stride_dkb,
    stride_dkt,
    stride_dkc,
    stride_dwt,
    T0,
    HI,
    KS,
    DI: tl.constexpr,
    BLOCK_DI: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_J: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    DK_MODE: tl.constexpr,
):
    """dq, dw of query row ``T0 + program_id(0)`` and one head block in registers. ``dk`` tiles (``DK_MODE``): 0
    none (the key-major pass computes ``dk``), 1 added to the fp32 ``DK [Tc, DI]`` at ``row * stride_dkc`` with
    atomics, 2 stored per pair into ``DK [head blocks, rows, K, DI]`` at ``hb * stride_dkb + (t - T0) *
    stride_dkt + slot * stride_dkc`` (reduced over the inverted index afterwards, no atomics)."""
    tt = tl.program_id(0).to(tl.int64)
    t = T0 + tt
    hb = tl.program_id(1).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mh = offs_h < HI
    offs_d = tl.arange(0, BLOCK_DI)
    md = offs_d < DI
    q = tl.load(
        Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=mh[:, None] & md[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_DI]
    if UPCAST:
        q = q.to(tl.float32)
    w = tl.load(W + t * stride_wt + offs_h, mask=mh, other=0.0).to(tl.float32)  # [BLOCK_H]
    dq = tl.zeros([BLOCK_H, BLOCK_DI], dtype=tl.float32)
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    end = _row_end(IDX + t * stride_it, KS, 256)
    for j0 in range(0, end, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        rows, valid, k = _gather_key_tile(K, IDX + t * stride_it, offs_j, KS, offs_d, md, stride_kc, UPCAST)
        g = tl.load(G + t * stride_gt + offs_j, mask=valid, other=0.0).to(tl.float32)  # [BLOCK_J], 0 at -1
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_H, BLOCK_J]
        dw += tl.sum(tl.maximum(s, 0.0) * g[None, :], 1)
        ds = tl.where(s > 0.0, w[:, None] * g[None, :], 0.0)  # [BLOCK_H, BLOCK_J]
        if UPCAST:
            ds_op = ds
        else:
            ds_op = ds.to(K.dtype.element_ty)
        dq = tl.dot(ds_op, k, dq, input_precision=PRECISION)
        if DK_MODE == 1:
            dk = tl.dot(tl.trans(ds_op), q, input_precision=PRECISION)  # [BLOCK_J, BLOCK_DI]
            tl.atomic_add(
                DK + rows[:, None] * stride_dkc + offs_d[None, :],
                dk,
                mask=valid[:, None] & md[None, :],
                sem="relaxed",
            )
        if DK_MODE == 2:
            dk = tl.dot(tl.trans(ds_op), q, input_precision=PRECISION)  # [BLOCK_J, BLOCK_DI]
            tl.store(
                DK + hb * stride_dkb + tt * stride_dkt + offs_j[:, None] * stride_dkc + offs_d[None, :],
                dk.to(DK.dtype.element_ty),
                mask=valid[:, None] & md[None, :],
            )
    tl.store(
        DQ + t * stride_dqt + offs_h[:, None] * stride_dqh + offs_d[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=mh[:, None] & md[None, :],
    )
    tl.store(DW + t * stride_dwt + offs_h, dw.to(DW.dtype.element_ty), mask=mh)


# Benchmarks may pin a launch config here: (BLOCK_H, BLOCK_J, num_warps, num_stages) or None for the default.
FWD_CONFIG_OVERRIDE: tuple[int, int, int, int] | None = None
BWD_CONFIG_OVERRIDE: tuple[int, int, int, int] | None = None


def _config(override, HI: int, DI: int, fp32: bool) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_J, num_warps, num_stages): interpreter tiles, a benchmark override, or the GPU tiles.

    Compiled for sm_90 (bf16, HI = 64, DI = 128): backward 64 x 64 / 8 warps / 2 stages = 200 registers, no spill,
    the gathered key tile arrives by cp.async (LDGSTS), dk by F32x4 vector reductions (REDG); 4 warps spill. Forward
    80 registers. fp32 ("ieee" dots run on FMA units, not the tensor cores): 32 x 16 tiles at 4 warps (255 registers,
    no spill; 64 x 32 spills 11 KiB per thread). DI = 256: half-width key tiles; DI = 512: also 32 heads.
    """
    block_h = min(64, max(16, next_pow2(HI)))
    block_di = next_pow2(DI)
    if interpreting():
        return block_h, 16, 4, 1
    if override is not None:
        return override
    if fp32:
        return min(block_h, 32 if block_di <= 128 else 16), 16, 4, 1
    if block_di <= 128:
        return block_h, 64, 8, 2
    return (block_h if block_di <= 256 else min(block_h, 32)), 32, 8, 2


def _fwd_config(HI: int, DI: int, fp32: bool) -> tuple[int, int, int, int]:
    return _config(FWD_CONFIG_OVERRIDE, HI, DI, fp32)


def _bwd_config(HI: int, DI: int, fp32: bool) -> tuple[int, int, int, int]:
    return _config(BWD_CONFIG_OVERRIDE, HI, DI, fp32)


def prepare_operands(q_idx, k_idx, weights):
    """Kernel operands: q and k in one dtype (fp64 -> fp32, mixed -> the wider), unit last stride."""
    dt = torch.promote_types(q_idx.dtype, k_idx.dtype)
    if dt == torch.float64:
        dt = torch.float32
    q = q_idx.to(dt)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k_idx.to(dt).contiguous()
    w = weights if weights.dtype != torch.float64 else weights.float()
    return q, k, w.contiguous()


def _meta(q: torch.Tensor, cfg) -> dict:
    block_h, block_j, warps, stages = cfg
    DI = q.shape[2]
    return dict(
        DI=DI,
        BLOCK_DI=max(16, next_pow2(DI)),
        BLOCK_H=block_h,
        BLOCK_J=block_j,
        UPCAST=interpreting(),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps,
        num_stages=stages,
    )


def scores_at_fwd(
    q_idx: torch.Tensor,  # [T, HI, DI]
    k_idx: torch.Tensor,  # [Tc, DI]
    weights: torch.Tensor,  # [T, HI]
    indices: torch.Tensor,  # [T, K] int32/int64, -1 = empty (values trusted: in [-1, Tc))
) -> torch.Tensor:
    """``score [T, K]`` fp32 (``-inf`` at ``-1``); not differentiable (see ``scores_at_autograd``)."""
    check_triton_device(q_idx, k_idx, weights, indices)
    T, HI, _ = q_idx.shape
    KS = indices.shape[1]
    out = torch.full((T, KS), float("-inf"), dtype=torch.float32, device=q_idx.device)
    if T == 0 or KS == 0 or k_idx.shape[0] == 0:  # Tc = 0: every (in-range) index is -1
        return out
    q, k, w = prepare_operands(q_idx, k_idx, weights)
    idx = indices.contiguous()
    _scores_at_fwd_kernel[(T,)](
        q,
        k,
        w,
        idx,
        out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        w.stride(0),
        idx.stride(0),
        out.stride(0),
        HI,
        KS,
        **_meta(q, _fwd_config(HI, q.shape[2], q.dtype == torch.float32)),
    )
    return out


def _launch_bwd(ops, dk, dk_strides, t0: int, n: int, dk_mode: int) -> None:
    """The backward kernel over query rows ``[t0, t0 + n)`` (``dk_mode``: the kernel's ``DK_MODE``)."""
    q, k, w, idx, g, dq, dw, cfg = ops
    _scores_at_bwd_kernel[(n, triton.cdiv(q.shape[1], cfg[0]))](
        q,
        k,
        w,
        idx,
        g,
        dq,
        dk,
        dw,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        w.stride(0),
        idx.stride(0),
        g.stride(0),
        dq.stride(0),
        dq.stride(1),
        *dk_strides,
        dw.stride(0),
        t0,
        q.shape[1],
        idx.shape[1],
        DK_MODE=dk_mode,
        **_meta(q, cfg),
    )


def _dk_inverted(ops, T: int, KS: int) -> torch.Tensor:
    """``dk [Tc, DI]`` fp32 without atomics: per chunk of query rows the kernel stores each pair's ``dk`` row
    (``DK_MODE`` 2), then the inverted-index gather-reduce adds each key's pairs in a fixed order. Sync-free."""
    q, k, cfg = ops[0], ops[1], ops[7]
    DI = q.shape[2]
    n_keys = k.shape[0]
    hb = triton.cdiv(q.shape[1], cfg[0])
    dk = torch.zeros((n_keys, DI), dtype=torch.float32, device=q.device)
    wave = 1 if q.device.type != "cuda" else max(1, sm_count(q.device.index or 0) // hb)
    tc = scores_at_config.rows_per_chunk(T, hb * KS * DI * 4, wave)
    # only the valid pairs' rows are written and read
    pairs = torch.empty((hb, tc, KS, DI), dtype=torch.float32, device=q.device)
    sp = sort_pairs(ops[3].reshape(-1), n_keys)  # pair (t, j) = position t * KS + j, one sort per backward
    for t0 in range(0, T, tc):
        n = min(tc, T - t0)
        _launch_bwd(ops, pairs, pairs.stride()[:3], t0, n, 2)
        index = chunk_index(sp, t0 * KS, (t0 + n) * KS, scores_at_config.piece())
        gather_reduce(pairs.view(hb, tc * KS, DI), index, dk, accumulate=True)
    return dk


def scores_at_bwd(
    q_idx: torch.Tensor,  # [T, HI, DI]
    k_idx: torch.Tensor,  # [Tc, DI]
    weights: torch.Tensor,  # [T, HI]
    indices: torch.Tensor,  # [T, K]
    grad: torch.Tensor,  # [T, K] d loss / d score (ignored where indices = -1)
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq [T, HI, DI] q dtype, dk [Tc, DI] k dtype, dw [T, HI] weights dtype)`` of the scores at ``indices``.

    ``deterministic``: ``dk`` without atomics, bitwise reproducible: the key-major pass of
    :mod:`.scores_at_keymajor` (``scores_at_config.DETERMINISTIC_DK = "keymajor"``, the default) or, with
    ``"inverted"``, the row kernel stores each pair's ``dk`` row and :func:`csa_kernels._inverted.gather_reduce`
    sums each key's pairs in (row, slot, head block) order, instead of fp32 atomics in the row kernel; ``dq`` and ``dw`` are deterministic either way."""
    check_triton_device(q_idx, k_idx, weights, indices, grad)
    T, HI, DI = q_idx.shape
    KS = indices.shape[1]
    if T == 0 or KS == 0 or k_idx.shape[0] == 0:
        return torch.zeros_like(q_idx), torch.zeros_like(k_idx), torch.zeros_like(weights)
    q, k, w = prepare_operands(q_idx, k_idx, weights)
    idx = indices.contiguous()
    g = grad if grad.stride(-1) == 1 else grad.contiguous()
    dq = torch.empty((T, HI, DI), dtype=q.dtype, device=q.device)
    dw = torch.empty((T, HI), dtype=w.dtype, device=q.device)
    cfg = _bwd_config(HI, DI, q.dtype == torch.float32)
    ops = (q, k, w, idx, g, dq, dw, cfg)
    if deterministic and scores_at_config.DETERMINISTIC_DK == "inverted":
        dk = _dk_inverted(ops, T, KS)
    else:
        dk = torch.zeros((0 if deterministic else k.shape[0], DI), dtype=torch.float32, device=q.device)
        _launch_bwd(ops, dk, (0, 0, dk.stride(0)), 0, T, 0 if deterministic else 1)
    if deterministic and scores_at_config.DETERMINISTIC_DK == "keymajor":
        dk = scores_at_dk_keymajor(q, k, w, idx, g, _meta(q, cfg)["PRECISION"])
    return dq.to(q_idx.dtype), dk.to(k_idx.dtype), dw.to(weights.dtype)
