"""Fused Triton compressor pooling (spec §3.2, §3.3), forward and backward.

Math (entry ``e`` = block ``w`` of its document, own block rows ``r0 .. r0 + m - 1``, ``m = ratio``)::

    own slots  j = 0 .. m-1 : v = kv[r0 + j, c_off + ch],      l = score[r0 + j, c_off + ch]      + ape[j, c_off + ch]
    prev slots j = 0 .. m-1 : v = kv[r0 - m + j, ch],          l = score[r0 - m + j, ch]          + ape[j, ch]
                              (overlap only; empty for w = 0: weight 0)
    a = softmax over all slots of l (per channel, fp32),  P[e, ch] = sum_slots a * v

with ``c_off = c`` for the overlapping layout (``Dk = 2c``) and ``c_off = 0`` otherwise (``Dk = c``, no prev slots).

Backward (``g = dP[e, ch]``): ``dv = a * g``, ``dl = a * (v - P) * g``; ``dscore = dl`` and ``dkv = dv`` land in
the rows / channels the slot was read from (each (row, channel) feeds exactly one entry, so plain stores, no
atomics; rows of incomplete tail blocks and the unused prev half of a document's last block keep 0), and
``dape[j, ch] += dl`` over all entries with fp32 atomics. Softmax statistics are recomputed in backward (the
pooling reads each input once; recomputation is cheaper than saving the ``[Tc, 2m, c]`` weights).

Schedule: one program per (entry, block of BLOCK_C channels) holding ``[BLOCK_M, BLOCK_C]`` tiles of the own and the
previous block. Memory bound: it reads ``kv`` and ``score`` once and writes ``[Tc, c]`` fp32.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from csa_kernels._triton_utils import check_triton_device, interpreting, next_pow2


@triton.jit
def _load_slots(KV, SCORE, APE, rows, ch, mask, stride_kv, stride_sc, stride_ape, offs_m):
    """Values and logits (score + ape, -inf where masked) of one half, both ``[BLOCK_M, BLOCK_C]`` fp32."""
    v = tl.load(KV + rows[:, None] * stride_kv + ch[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(SCORE + rows[:, None] * stride_sc + ch[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.load(APE + offs_m[:, None] * stride_ape + ch[None, :], mask=mask, other=0.0).to(tl.float32)
    return v, tl.where(mask, s + a, -float("inf"))


@triton.jit
def _pool_stats(v_own, l_own, v_prev, l_prev, OVERLAP: tl.constexpr):
    """Per-channel softmax over the slots: ``(weights own, weights prev, pooled P)``."""
    m = tl.max(l_own, 0)
    if OVERLAP:
        m = tl.maximum(m, tl.max(l_prev, 0))
    m = tl.where(m == -float("inf"), 0.0, m)  # channel-masked lanes: keep them finite
    e_own = tl.exp(l_own - m[None, :])
    den = tl.sum(e_own, 0)
    num = tl.sum(e_own * v_own, 0)
    e_prev = e_own  # placeholder of the right shape when not overlapping (unused)
    if OVERLAP:
        e_prev = tl.exp(l_prev - m[None, :])
        den += tl.sum(e_prev, 0)
        num += tl.sum(e_prev * v_prev, 0)
    den = tl.where(den > 0, den, 1.0)
    inv = 1.0 / den
    return e_own * inv[None, :], e_prev * inv[None, :], num * inv


@triton.jit
def _compressor_pool_kernel(
    KV,
    SCORE,
    APE,
    START,
    BLK,
    OUT,
    DOUT,
    DKV,
    DSCORE,
    DAPE,
    stride_kv,
    stride_sc,
    stride_ape,
    stride_o,
    stride_dkv,
    stride_dsc,
    C,
    C_OFF,
    RATIO,
    OVERLAP: tl.constexpr,
    BACKWARD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    r0 = tl.load(START + e).to(tl.int64)  # first row of the entry's own block
    w = tl.load(BLK + e)  # block index inside the document (0: no previous half)
    offs_m = tl.arange(0, BLOCK_M)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    mm = offs_m < RATIO
    mc = offs_c < C
    own_ch = offs_c + C_OFF  # own-half channels: [c, 2c) when overlapping, [0, c) otherwise
    rows_own = r0 + offs_m
    mask_own = mm[:, None] & mc[None, :]
    v_own, l_own = _load_slots(
        KV, SCORE, APE, rows_own, own_ch, mask_own, stride_kv, stride_sc, stride_ape, offs_m
    )
    rows_prev = tl.maximum(r0 - RATIO + offs_m, 0)
    mask_prev = mask_own & (w > 0)
    v_prev = v_own
    l_prev = l_own
    if OVERLAP:
        v_prev, l_prev = _load_slots(
            KV, SCORE, APE, rows_prev, offs_c, mask_prev, stride_kv, stride_sc, stride_ape, offs_m
        )
    a_own, a_prev, pooled = _pool_stats(v_own, l_own, v_prev, l_prev, OVERLAP)
    if not BACKWARD:
        tl.store(OUT + e * stride_o + offs_c, pooled, mask=mc)
    else:
        g = tl.load(DOUT + e * stride_o + offs_c, mask=mc, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_C]
        d_own = a_own * (v_own - pooled[None, :]) * g
        tl.store(
            DKV + rows_own[:, None] * stride_dkv + own_ch[None, :],
            (a_own * g).to(DKV.dtype.element_ty),
            mask=mask_own,
        )
        tl.store(
            DSCORE + rows_own[:, None] * stride_dsc + own_ch[None, :],
            d_own.to(DSCORE.dtype.element_ty),
            mask=mask_own,
        )
        tl.atomic_add(
            DAPE + offs_m[:, None] * stride_ape + own_ch[None, :], d_own, mask=mask_own, sem="relaxed"
        )
        if OVERLAP:
            d_prev = a_prev * (v_prev - pooled[None, :]) * g
            tl.store(
                DKV + rows_prev[:, None] * stride_dkv + offs_c[None, :],
                (a_prev * g).to(DKV.dtype.element_ty),
                mask=mask_prev,
            )
            tl.store(
                DSCORE + rows_prev[:, None] * stride_dsc + offs_c[None, :],
                d_prev.to(DSCORE.dtype.element_ty),
                mask=mask_prev,
            )
            tl.atomic_add(
                DAPE + offs_m[:, None] * stride_ape + offs_c[None, :], d_prev, mask=mask_prev, sem="relaxed"
            )


def entry_blocks(cu_seqlens: torch.Tensor, cu: list[int], ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per compressed entry: ``(first row of its own block [Tc] int32, block index in its document [Tc] int32)``.

    ``cu`` is ``cu_seqlens`` as a host list (already validated); the tensors are built on ``cu_seqlens.device``.
    """
    dev = cu_seqlens.device
    lens_c = [(b - a) // ratio for a, b in itertools.pairwise(cu)]
    tc = sum(lens_c)
    cu_t = cu_seqlens.to(torch.int64)
    n_c = torch.tensor(lens_c, dtype=torch.int64, device=dev)
    cuc = torch.zeros(len(lens_c) + 1, dtype=torch.int64, device=dev)
    cuc[1:] = n_c.cumsum(0)
    doc = torch.repeat_interleave(torch.arange(len(lens_c), device=dev), n_c, output_size=tc)  # [Tc]
    blk = torch.arange(tc, device=dev) - cuc[doc]
    start = cu_t[doc] + blk * ratio
    return start.to(torch.int32), blk.to(torch.int32)


def _config(ratio: int, c: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_C, num_warps): tiles of about 1-4K elements per half."""
    block_m = next_pow2(ratio)
    if interpreting():
        return block_m, min(next_pow2(c), 64), 4
    block_c = max(16, min(next_pow2(c), 4096 // block_m, 256))
    return block_m, block_c, 4


def _launch(kv, score, ape, start, blk, ratio, overlap, out, dout=None, dkv=None, dscore=None, dape=None):
    tc = start.shape[0]
    c = kv.shape[1] // 2 if overlap else kv.shape[1]
    block_m, block_c, warps = _config(ratio, c)
    backward = dout is not None
    dummy = out if out is not None else dout
    _compressor_pool_kernel[(tc, triton.cdiv(c, block_c))](
        kv,
        score,
        ape,
        start,
        blk,
        dummy,
        dout if backward else dummy,
        dkv if backward else kv,
        dscore if backward else score,
        dape if backward else ape,
        kv.stride(0),
        score.stride(0),
        ape.stride(0),
        dummy.stride(0),
        dkv.stride(0) if backward else kv.stride(0),
        dscore.stride(0) if backward else score.stride(0),
        c,
        c if overlap else 0,
        ratio,
        OVERLAP=overlap,
        BACKWARD=backward,
        BLOCK_M=block_m,
        BLOCK_C=block_c,
        num_warps=warps,
    )


def compressor_pool_fwd(kv, score, ape, start, blk, ratio: int, overlap: bool) -> torch.Tensor:
    """``pooled [Tc, c]`` fp32 (inputs contiguous in the channel dim; ``ape`` fp32)."""
    check_triton_device(kv, score, ape)
    c = kv.shape[1] // 2 if overlap else kv.shape[1]
    out = torch.empty((start.shape[0], c), dtype=torch.float32, device=kv.device)
    if start.shape[0] and c:
        _launch(kv, score, ape, start, blk, ratio, overlap, out)
    return out


def compressor_pool_bwd(kv, score, ape, start, blk, ratio: int, overlap: bool, dout: torch.Tensor):
    """``(dkv [T, Dk] kv.dtype, dscore [T, Dk] score.dtype, dape [ratio, Dk] fp32)``."""
    dkv = torch.zeros_like(kv)
    dscore = torch.zeros_like(score)
    dape = torch.zeros(ape.shape, dtype=torch.float32, device=ape.device)
    if start.shape[0] and kv.shape[1]:
        _launch(kv, score, ape, start, blk, ratio, overlap, None, dout.contiguous(), dkv, dscore, dape)
    return dkv, dscore, dape
