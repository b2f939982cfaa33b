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
def _entry_block(CU, CUC, e, N_DOCS, SEARCH_STEPS):
    """(first row of entry ``e``'s own block, its block index in the document): binary search of the document
    ``d`` with ``cu_seqlens_c[d] <= e < cu_seqlens_c[d+1]`` (empty documents never match)."""
    lo = e * 0  # int scalar
    hi = lo + N_DOCS - 1
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        go = tl.load(CUC + mid) <= e
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    c0 = tl.load(CUC + lo)
    blk = e - c0
    return tl.load(CU + lo).to(tl.int64), blk


@triton.jit
def _compressor_pool_kernel(
    KV,
    SCORE,
    APE,
    CU,
    CUC,
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
    N_DOCS,
    SEARCH_STEPS,
    OVERLAP: tl.constexpr,
    BACKWARD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    doc_start, w = _entry_block(CU, CUC, e, N_DOCS, SEARCH_STEPS)  # w = block index (0: no previous half)
    r0 = doc_start + w * RATIO  # first row of the entry's own block
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


def compressed_offsets(cu: list[int], ratio: int) -> list[int]:
    """Host list ``cu_seqlens_c`` from the validated host list ``cu`` (``floor(len_i / ratio)`` entries per doc)."""
    out = [0]
    for a, b in itertools.pairwise(cu):
        out.append(out[-1] + (b - a) // ratio)
    return out


def _config(ratio: int, c: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_C, num_warps): tiles of about 1-4K elements per half."""
    block_m = next_pow2(ratio)
    if interpreting():
        return block_m, min(next_pow2(c), 64), 4
    block_c = max(16, min(next_pow2(c), 4096 // block_m, 256))
    return block_m, block_c, 4


def _launch(kv, score, ape, cu, cuc, tc, ratio, overlap, out, dout=None, dkv=None, dscore=None, dape=None):
    n_docs = cu.shape[0] - 1
    c = kv.shape[1] // 2 if overlap else kv.shape[1]
    block_m, block_c, warps = _config(ratio, c)
    backward = dout is not None
    dummy = out if out is not None else dout
    _compressor_pool_kernel[(tc, triton.cdiv(c, block_c))](
        kv,
        score,
        ape,
        cu,
        cuc,
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
        n_docs,
        max(1, n_docs).bit_length(),
        OVERLAP=overlap,
        BACKWARD=backward,
        BLOCK_M=block_m,
        BLOCK_C=block_c,
        num_warps=warps,
    )


def compressor_pool_fwd(kv, score, ape, cu, cuc, tc: int, ratio: int, overlap: bool) -> torch.Tensor:
    """``pooled [Tc, c]`` fp32 (inputs contiguous in the channel dim; ``ape`` fp32; ``cu``, ``cuc`` int32 on the
    device, ``tc`` their entry count)."""
    check_triton_device(kv, score, ape)
    c = kv.shape[1] // 2 if overlap else kv.shape[1]
    out = torch.empty((tc, c), dtype=torch.float32, device=kv.device)
    if tc and c:
        _launch(kv, score, ape, cu, cuc, tc, ratio, overlap, out)
    return out


def compressor_pool_bwd(kv, score, ape, cu, cuc, tc: int, ratio: int, overlap: bool, dout: torch.Tensor):
    """``(dkv [T, Dk] kv.dtype, dscore [T, Dk] score.dtype, dape [ratio, Dk] fp32)``."""
    dkv = torch.zeros_like(kv)
    dscore = torch.zeros_like(score)
    dape = torch.zeros(ape.shape, dtype=torch.float32, device=ape.device)
    if tc and kv.shape[1]:
        _launch(kv, score, ape, cu, cuc, tc, ratio, overlap, None, dout.contiguous(), dkv, dscore, dape)
    return dkv, dscore, dape
