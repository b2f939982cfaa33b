"""Fused Triton kernels for sparse shared-KV MQA attention with a sink (forward and backward).

Math (per token ``t``, head ``h``; ``j`` runs over the token's gathered rows ``kv[idx[t, j]]``, ``-1`` skipped)::

    z[t,h,j] = scale * <q[t,h], kv[idx[t,j]]>
    lse[t,h] = log( sum_j exp(z[t,h,j]) + exp(sink[h]) )          # the sink is inside the denominator
    o[t,h]   = sum_j exp(z[t,h,j] - lse[t,h]) * kv[idx[t,j]]       # K = V (shared rows); the sink has no value

Schedule (as FlashMLA's sparse prefill): one program per (token, block of heads). All heads of one token sit on
the MMA M dimension and share every gathered KV row, so a row is read once per 64 heads and used for both the
score GEMM (as K) and the output GEMM (as V). Indices are compacted per token on the host (valid first) so each
program loops only over ``ceil(count / BLOCK_N)`` blocks.

Backward (``dL/dz = p * (dP - delta)``, ``delta = <do, o>``, ``dsink[h] = -sum_t exp(sink[h] - lse[t,h]) delta[t,h]``):
two kernels, each one program per (token, head block), recompute ``p`` from the saved LSE. The first accumulates
``dq`` in registers; the second (:mod:`.dkv_tokenmajor`) forms ``scale * ds^T q + p^T do`` per gathered row (K and
V gradients of the shared row together) and adds it into ``dkv`` with fp32 atomics, or, deterministic, stores it per
(token, slot) pair and reduces each kv row's pairs over an inverted index. Splitting keeps each kernel's fp32 accumulator ([64, 512] = half the register file) alone
in registers, at the price of recomputing the two score GEMMs (7 GEMM passes instead of 5).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from csa_kernels._triton_utils import check_triton_device, interpreting, next_pow2
from csa_kernels.ops.sparse_attn import launch_config
from csa_kernels.ops.sparse_attn.dkv_keymajor import dkv_keymajor
from csa_kernels.ops.sparse_attn.dkv_tokenmajor import dkv_atomic, dkv_inverted

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _sparse_attn_fwd_kernel(
    Q,
    KV,
    SINK,
    IDX,
    CNT,
    O,
    LSE,
    stride_qt,
    stride_qh,
    stride_kvn,
    stride_it,
    stride_ot,
    stride_oh,
    H,
    qk_scale_log2,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < H
    mask_d = offs_d < D
    q = tl.load(
        Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    cnt = tl.load(CNT + t)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start in range(0, cnt, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        valid = offs_n < cnt
        idx = tl.load(IDX + t * stride_it + offs_n, mask=valid, other=0).to(tl.int64)
        kv = tl.load(
            KV + idx[:, None] * stride_kvn + offs_d[None, :], mask=valid[:, None] & mask_d[None, :], other=0.0
        )  # [BLOCK_N, BLOCK_D]
        if UPCAST:
            kv = kv.to(tl.float32)
        s = (
            tl.dot(q, tl.trans(kv), input_precision=PRECISION) * qk_scale_log2
        )  # [BLOCK_H, BLOCK_N], log2 units
        s = tl.where(valid[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(kv.dtype), kv, acc, input_precision=PRECISION)
        m_i = m_new
    sink = tl.load(SINK + offs_h, mask=mask_h, other=0.0).to(tl.float32) * 1.4426950408889634
    m_fin = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_fin)
    l_fin = l_i * alpha + tl.exp2(sink - m_fin)
    o = acc * (alpha / l_fin)[:, None]
    tl.store(
        O + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
        o.to(O.dtype.element_ty),
        mask=mask_h[:, None] & mask_d[None, :],
    )
    lse = (m_fin + tl.log2(l_fin)) * 0.6931471805599453
    tl.store(LSE + t * H + offs_h, lse, mask=mask_h)


@triton.jit
def _sparse_attn_bwd_dq_kernel(
    Q,
    KV,
    DO,
    LSE,
    DELTA,
    IDX,
    CNT,
    DQ,
    PDP,
    stride_qt,
    stride_qh,
    stride_kvn,
    stride_dot,
    stride_doh,
    stride_it,
    stride_dqt,
    stride_dqh,
    H,
    scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dq[t,h] = scale * sum_j ds[t,h,j] kv_j with ds = p (dp - delta); one program per (token, head block).

    Also writes ``PDP[t,h] = sum_j p[t,h,j] dp[t,h,j]`` (fp32 from the fp32 softmax statistics): the exact
    ``<do, o>`` of the unrounded output, from which the sink gradient is taken (``delta`` comes from the rounded
    ``o`` and would carry its bf16 error into ``dsink``, where the sum over tokens cancels).
    """
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < H
    mask_d = offs_d < D
    mask_hd = mask_h[:, None] & mask_d[None, :]
    q = tl.load(Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :], mask=mask_hd, other=0.0)
    do = tl.load(
        DO + t * stride_dot + offs_h[:, None] * stride_doh + offs_d[None, :], mask=mask_hd, other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2 = tl.load(LSE + t * H + offs_h, mask=mask_h, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + t * H + offs_h, mask=mask_h, other=0.0)
    qk_scale_log2 = scale * 1.4426950408889634
    cnt = tl.load(CNT + t)
    dq = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    pdp = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(0, cnt, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        valid = offs_n < cnt
        idx = tl.load(IDX + t * stride_it + offs_n, mask=valid, other=0).to(tl.int64)
        kv = tl.load(
            KV + idx[:, None] * stride_kvn + offs_d[None, :], mask=valid[:, None] & mask_d[None, :], other=0.0
        )  # [BLOCK_N, BLOCK_D]
        if UPCAST:
            kv = kv.to(tl.float32)
        s = tl.dot(q, tl.trans(kv), input_precision=PRECISION) * qk_scale_log2
        p = tl.exp2(s - lse2[:, None])
        p = tl.where(valid[None, :] & mask_h[:, None], p, 0.0)  # [BLOCK_H, BLOCK_N]
        dp = tl.dot(do, tl.trans(kv), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])  # dL/dz (z already scaled)
        pdp += tl.sum(p * dp, 1)
        dq = tl.dot(ds.to(kv.dtype), kv, dq, input_precision=PRECISION)
    tl.store(
        DQ + t * stride_dqt + offs_h[:, None] * stride_dqh + offs_d[None, :],
        (dq * scale).to(DQ.dtype.element_ty),
        mask=mask_hd,
    )
    tl.store(PDP + t * H + offs_h, pdp, mask=mask_h)


@triton.jit
def _delta_kernel(
    O,
    DO,
    DELTA,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    H,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    m = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    o = tl.load(O + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], mask=m, other=0.0).to(
        tl.float32
    )
    do = tl.load(DO + t * stride_dot + offs_h[:, None] * stride_doh + offs_d[None, :], mask=m, other=0.0).to(
        tl.float32
    )
    tl.store(DELTA + t * H + offs_h, tl.sum(o * do, 1), mask=offs_h < H)


def compact_indices(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the valid (>= 0) indices of each row to the front, keeping their order; returns (indices, counts).

    The kernels loop only over ``ceil(count / BLOCK_N)`` blocks of a row, so rows with many ``-1`` slots
    (early tokens, short documents) cost only their valid work.
    """
    invalid = indices < 0  # [T, K]
    counts = (~invalid).sum(1, dtype=torch.int32)  # [T]
    order = torch.sort(invalid.to(torch.int8), dim=1, stable=True).indices
    return indices.gather(1, order).contiguous(), counts


# Benchmarks may pin a launch config here: (BLOCK_H, BLOCK_N, num_warps, num_stages) or None for the default.
FWD_CONFIG_OVERRIDE: tuple[int, int, int, int] | None = None
BWD_CONFIG_OVERRIDE: tuple[int, int, int, int] | None = None


def _precision(q: torch.Tensor) -> str:
    """``input_precision`` of the kernels' dots: exact fp32 ("ieee") for fp32 inputs; bf16/fp16 ignore it."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _config(override, H: int, fp32_tiles: bool, fp32: tuple, tiles: tuple) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages): the interpreter's small tiles, a benchmark override, or the GPU
    tiles ``(BLOCK_N, warps, stages)`` (``fp32 = (BLOCK_H cap, BLOCK_N, warps, stages)`` for fp32 at D > 256)."""
    if interpreting():
        return min(next_pow2(H), 64), 16, 4, 1
    if override is not None:
        return override
    block_h = 64 if H >= 64 else max(16, next_pow2(H))
    if fp32_tiles:
        return min(block_h, fp32[0]), *fp32[1:]
    return block_h, *tiles


def _fwd_config(D: int, H: int, itemsize: int = 2) -> tuple[int, int, int, int]:
    """Forward kernel tiles. fp32 (exact "ieee" dots): 32 x 32 q / kv tiles, 135 KiB of shared memory. bf16: two
    stages turn the gathered KV tile into cp.async copies (LDGSTS) into shared memory instead of register loads whose
    latency every iteration waited for (ncu: "long scoreboard" the top stall, tensor pipe 25% busy); H200 at D=512,
    V4-Flash S=4096: BN 64 / 2 stages 1.285 ms vs 1 stage 1.83 ms; BN 32 / 3-4 stages 1.66 ms."""
    return _config(FWD_CONFIG_OVERRIDE, H, itemsize >= 4 and D > 256, (32, 32, 8, 1), (64, 8, 2))


def _bwd_config(D: int, H: int, itemsize: int = 2) -> tuple[int, int, int, int]:
    """``dq`` / ``dkv`` kernel tiles. fp32: [16, 512] q / do / dq tiles, 99 KiB of shared memory. bf16: H200 sweep at
    D=512 (with the dkv kernel at BN 64, DC 128): 6.54 ms vs 7.76 ms."""
    return _config(BWD_CONFIG_OVERRIDE, H, itemsize >= 4 and D > 256, (16, 16, 8, 1), (64, 8, 1))


def sparse_attn_fwd(
    q: torch.Tensor,  # [T, H, D]
    kv: torch.Tensor,  # [Nkv, D]
    attn_sink: torch.Tensor,  # [H] fp32
    indices: torch.Tensor,  # [T, K] int32 (compacted: valid first)
    counts: torch.Tensor,  # [T] int32
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward kernel launch; returns ``(o [T, H, D] in q.dtype, lse [T, H] fp32)``."""
    check_triton_device(q, kv, attn_sink, indices)
    T, H, D = q.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if T == 0:
        return o, lse
    block_h, block_n, warps, stages = _fwd_config(D, H, q.element_size())
    grid = (T, triton.cdiv(H, block_h))
    _sparse_attn_fwd_kernel[grid](
        q,
        kv,
        attn_sink.float().contiguous(),
        indices,
        counts,
        o,
        lse,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        indices.stride(0),
        o.stride(0),
        o.stride(1),
        H,
        softmax_scale * LOG2E,
        D=D,
        BLOCK_D=next_pow2(D),
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        UPCAST=interpreting(),
        PRECISION=_precision(q),
        num_warps=warps,
        num_stages=stages,
    )
    return o, lse


def sparse_attn_bwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    attn_sink: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    softmax_scale: float,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward kernels; returns ``(dq [T,H,D] q.dtype, dkv [Nkv,D] kv.dtype, dsink [H] fp32)``.

    ``deterministic``: ``dkv`` without atomics, bitwise reproducible: the token-major kernel's pair rows reduced
    per kv row over an inverted index (:mod:`.dkv_tokenmajor`; or, with ``launch_config.DETERMINISTIC_DKV =
    "keymajor"``, the key-major pass of :mod:`.dkv_keymajor`) instead of the same kernel with fp32 atomics.
    ``dq`` and ``dsink`` are deterministic either way.
    """
    T, H, D = q.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    do = do if do.stride(-1) == 1 else do.contiguous()
    kv = kv.contiguous()
    dq = torch.empty_like(q)
    delta = torch.empty((T, H), dtype=torch.float32, device=q.device)
    pdp = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if T == 0:
        return dq, torch.zeros_like(kv), torch.zeros_like(attn_sink, dtype=torch.float32)
    bd = next_pow2(D)
    dh = min(next_pow2(H), 16)
    _delta_kernel[(T, triton.cdiv(H, dh))](
        o, do, delta, o.stride(0), o.stride(1), do.stride(0), do.stride(1), H, D=D, BLOCK_D=bd, BLOCK_H=dh
    )
    block_h, block_n, warps, stages = _bwd_config(D, H, q.element_size())
    args = (q, kv, do, lse, delta, indices, counts)
    strides = (q.stride(0), q.stride(1), kv.stride(0), do.stride(0), do.stride(1), indices.stride(0))
    grid = (T, triton.cdiv(H, block_h))
    meta = dict(
        D=D,
        BLOCK_D=bd,
        BLOCK_H=block_h,
        UPCAST=interpreting(),
        PRECISION=_precision(q),
        num_warps=warps,
        num_stages=stages,
    )
    _sparse_attn_bwd_dq_kernel[grid](
        *args, dq, pdp, *strides, dq.stride(0), dq.stride(1), H, softmax_scale, BLOCK_N=block_n, **meta
    )
    if not deterministic:
        dkv32 = dkv_atomic(args, softmax_scale, dict(meta, BLOCK_N=block_n))
    elif launch_config.DETERMINISTIC_DKV == "keymajor":
        dkv32 = dkv_keymajor(q, kv, do, lse, delta, indices, counts, softmax_scale, _precision(q))
    else:
        dkv32 = dkv_inverted(args, softmax_scale, dict(meta, BLOCK_N=block_n))
    # dsink[h] = -sum_t p_sink[t,h] * <do, o>[t,h],  p_sink = exp(sink - lse); <do, o> = sum_j p dp in fp32
    dsink = -(torch.exp(attn_sink.float()[None, :] - lse) * pdp).sum(0)
    return dq, dkv32.to(kv.dtype), dsink


def default_softmax_scale(D: int) -> float:
    return 1.0 / math.sqrt(D)
