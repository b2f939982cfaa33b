"""Token-major ``dkv`` of the sparse attention: the per-pair gradient rows, added with fp32 atomics (default) or
stored and reduced per kv row over an inverted index (deterministic, no atomics).

Math (``ds = p (dp - delta)``, ``j`` over the valid slots of token ``t``, repeated slots counted once each)::

    c[t, j, :]  = sum_h ( scale * ds[t,h,j] * q[t,h,:] + p[t,h,j] * do[t,h,:] )      # one pair's gradient row
    dkv[r, :]   = sum_{(t, j): idx[t, j] = r} c[t, j, :]

fp32 reference of ``dkv`` (``p``, ``ds`` ``[T, H, K]`` from the saved LSE, ``valid = idx >= 0``)::

    c = torch.einsum("thk,thd->tkd", scale * ds, q) + torch.einsum("thk,thd->tkd", p, do)   # [T, K, D]
    dkv = torch.zeros(Nkv, D).index_add_(0, idx[valid], c[valid])

Both modes run the same kernel, one program per (token, head block): it recomputes ``s`` and ``dp`` for a block of
``BLOCK_N`` gathered rows (head dim streamed in ``BLOCK_DC`` chunks, no ``[64, 512]`` tile resident) and forms the
``[BLOCK_N, BLOCK_DC]`` tiles of ``c`` by two MMAs per chunk. ``PAIRS = False``: the tiles are added into the fp32
``dkv`` with relaxed atomics (summation order varies run to run). ``PAIRS = True``: they are stored at their pair
position ``[head block, token, slot]`` of a pair buffer, and :func:`csa_kernels._inverted.gather_reduce` sums each
kv row's pairs in ``(token, slot, head block)`` order (the pairs sorted once per backward) (no atomics; two runs give the same bits; cost proportional to
the pairs however the indices collide, hot rows split into fixed pieces). Tokens go in chunks whose pair buffer
fits ``launch_config.PAIR_BYTES``; each chunk's reduce adds into ``dkv`` (one writer per row, chunks in order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from csa_kernels._inverted import chunk_index, gather_reduce, sort_pairs
from csa_kernels._triton_utils import interpreting, sm_count
from csa_kernels.ops.sparse_attn import launch_config


@triton.jit
def _sparse_attn_bwd_dkv_kernel(
    Q,
    KV,
    DO,
    LSE,
    DELTA,
    IDX,
    CNT,
    OUT,
    stride_qt,
    stride_qh,
    stride_kvn,
    stride_dot,
    stride_doh,
    stride_it,
    stride_ob,
    stride_ot,
    stride_on,
    T0,
    H,
    scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    PAIRS: tl.constexpr,
):
    """Token ``T0 + program_id(0)``, head block ``program_id(1)``: the tiles of ``c`` (module docstring) added into
    ``OUT = dkv`` at ``idx * stride_on`` with fp32 atomics, or (``PAIRS``) stored into the pair buffer at
    ``hb * stride_ob + (token - T0) * stride_ot + slot * stride_on``."""
    tt = tl.program_id(0).to(tl.int64)
    t = T0 + tt
    hb = tl.program_id(1).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    lse2 = tl.load(LSE + t * H + offs_h, mask=mask_h, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + t * H + offs_h, mask=mask_h, other=0.0)
    qk_scale_log2 = scale * 1.4426950408889634
    cnt = tl.load(CNT + t)
    q_base = Q + t * stride_qt + offs_h[:, None] * stride_qh
    do_base = DO + t * stride_dot + offs_h[:, None] * stride_doh
    for start in range(0, cnt, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        valid = offs_n < cnt
        idx = tl.load(IDX + t * stride_it + offs_n, mask=valid, other=0).to(tl.int64)
        s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        dp = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        for c in tl.static_range(0, BLOCK_D, BLOCK_DC):
            offs_c = c + tl.arange(0, BLOCK_DC)
            mc = offs_c < D
            qc = tl.load(q_base + offs_c[None, :], mask=mask_h[:, None] & mc[None, :], other=0.0)
            doc = tl.load(do_base + offs_c[None, :], mask=mask_h[:, None] & mc[None, :], other=0.0)
            kvc = tl.load(
                KV + idx[:, None] * stride_kvn + offs_c[None, :], mask=valid[:, None] & mc[None, :], other=0.0
            )
            if UPCAST:
                qc = qc.to(tl.float32)
                doc = doc.to(tl.float32)
                kvc = kvc.to(tl.float32)
            s = tl.dot(qc, tl.trans(kvc), s, input_precision=PRECISION)
            dp = tl.dot(doc, tl.trans(kvc), dp, input_precision=PRECISION)
        p = tl.exp2(s * qk_scale_log2 - lse2[:, None])
        p = tl.where(valid[None, :] & mask_h[:, None], p, 0.0)  # [BLOCK_H, BLOCK_N]
        ds = p * (dp - delta[:, None]) * scale
        if UPCAST:
            p_t = tl.trans(p)
            ds_t = tl.trans(ds)
        else:
            p_t = tl.trans(p.to(KV.dtype.element_ty))
            ds_t = tl.trans(ds.to(KV.dtype.element_ty))
        for c in tl.static_range(0, BLOCK_D, BLOCK_DC):
            offs_c = c + tl.arange(0, BLOCK_DC)
            mc = offs_c < D
            qc = tl.load(q_base + offs_c[None, :], mask=mask_h[:, None] & mc[None, :], other=0.0)
            doc = tl.load(do_base + offs_c[None, :], mask=mask_h[:, None] & mc[None, :], other=0.0)
            if UPCAST:
                qc = qc.to(tl.float32)
                doc = doc.to(tl.float32)
            dkv = tl.dot(p_t, doc, input_precision=PRECISION)  # [BLOCK_N, BLOCK_DC]
            dkv = tl.dot(ds_t, qc, dkv, input_precision=PRECISION)
            if PAIRS:
                tl.store(
                    OUT + hb * stride_ob + tt * stride_ot + offs_n[:, None] * stride_on + offs_c[None, :],
                    dkv.to(OUT.dtype.element_ty),
                    mask=valid[:, None] & mc[None, :],
                )
            else:
                tl.atomic_add(
                    OUT + idx[:, None] * stride_on + offs_c[None, :],
                    dkv,
                    mask=valid[:, None] & mc[None, :],
                    sem="relaxed",
                )


def _launch(args, out, strides, t0, n_tok, hb, H, scale, meta, pairs: bool):
    q = args[0]
    D = q.shape[2]
    block_n, block_dc, warps, stages = launch_config.dkv_tiles(
        meta["BLOCK_N"], meta["BLOCK_D"], q.element_size() >= 4 and D > 256
    )
    _sparse_attn_bwd_dkv_kernel[(n_tok, hb)](
        *args,
        out,
        *strides,
        t0,
        H,
        scale,
        D=D,
        BLOCK_D=meta["BLOCK_D"],
        BLOCK_H=meta["BLOCK_H"],
        BLOCK_N=block_n,
        BLOCK_DC=block_dc,
        UPCAST=interpreting(),
        PRECISION=meta["PRECISION"],
        PAIRS=pairs,
        num_warps=warps,
        num_stages=stages,
    )


def dkv_atomic(args: tuple, scale: float, meta: dict) -> torch.Tensor:
    """``dkv [Nkv, D]`` fp32 with fp32 atomics (not bitwise reproducible). ``args = (q [T,H,D], kv [Nkv,D], do,
    lse [T,H], delta [T,H], idx [T,K] compacted, counts [T])``; ``meta``: ``BLOCK_D``, ``BLOCK_H``, ``BLOCK_N``
    (the dq kernel's, interpreter only), ``PRECISION``."""
    q, kv, do, _, _, idx, _ = args
    T, H, _ = q.shape
    dkv32 = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    strides = (q.stride(0), q.stride(1), kv.stride(0), do.stride(0), do.stride(1), idx.stride(0))
    hb = triton.cdiv(H, meta["BLOCK_H"])
    _launch(args, dkv32, (*strides, 0, 0, dkv32.stride(0)), 0, T, hb, H, scale, meta, pairs=False)
    return dkv32


def dkv_inverted(args: tuple, scale: float, meta: dict) -> torch.Tensor:
    """``dkv [Nkv, D]`` fp32 from stored pair rows and the inverted-index gather-reduce (module docstring): no
    atomics, bitwise reproducible, no device -> host sync. Arguments as in :func:`dkv_atomic`."""
    q, kv, do, _, _, idx, _ = args
    T, H, D = q.shape
    K = idx.shape[1]
    n_rows = kv.shape[0]
    hb = triton.cdiv(H, meta["BLOCK_H"])
    dkv32 = torch.zeros((n_rows, D), dtype=torch.float32, device=kv.device)
    if T == 0 or K == 0 or n_rows == 0:
        return dkv32
    pdt = launch_config.pair_dtype(q.dtype)
    itemsize = torch.finfo(pdt).bits // 8
    wave = 1 if q.device.type != "cuda" else max(1, sm_count(q.device.index or 0) // hb)
    tc = launch_config.tokens_per_chunk(T, hb * K * D * itemsize, wave)
    pairs = torch.empty(
        (hb, tc, K, D), dtype=pdt, device=q.device
    )  # only valid pairs' rows are written / read
    strides = (q.stride(0), q.stride(1), kv.stride(0), do.stride(0), do.stride(1), idx.stride(0))
    sp = sort_pairs(idx.reshape(-1), n_rows)  # pair (t, j) = position t * K + j, one sort per backward
    for t0 in range(0, T, tc):
        n = min(tc, T - t0)
        _launch(args, pairs, (*strides, *pairs.stride()[:3]), t0, n, hb, H, scale, meta, pairs=True)
        index = chunk_index(sp, t0 * K, (t0 + n) * K, launch_config.piece())
        gather_reduce(pairs.view(hb, tc * K, D), index, dkv32, accumulate=True)
    return dkv32
