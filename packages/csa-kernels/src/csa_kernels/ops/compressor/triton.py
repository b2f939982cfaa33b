"""Fused Triton compressor pooling (spec §3.2, §3.3), forward and backward.

Math (entry ``e`` = block ``w`` of its document, own block rows ``r0 .. r0 + m - 1``, ``m = ratio``)::

    own slots  j = 0 .. m-1 : v = kv[r0 + j, c_off + ch],      l = score[r0 + j, c_off + ch]      + ape[j, c_off + ch]
    prev slots j = 0 .. m-1 : v = kv[r0 - m + j, ch],          l = score[r0 - m + j, ch]          + ape[j, ch]
                              (overlap only; empty for w = 0: weight 0)
    a = softmax over all slots of l (per channel, fp32),  P[e, ch] = sum_slots a * v

with ``c_off = c`` for the overlapping layout (``Dk = 2c``) and ``c_off = 0`` otherwise (``Dk = c``, no prev slots).

Backward (``g = dP[e, ch]``): ``dv = a * g``, ``dl = a * (v - P) * g``; ``dscore = dl`` and ``dkv = dv`` land in
the rows / channels the slot was read from (each (row, channel) feeds exactly one entry, so plain stores, no
atomics; the kernel writes 0 to the rows of incomplete tail blocks, of documents without a complete block and
to the unused prev half of a document's last block, so the gradient buffers need no zero fill), and
``dape[j, ch] += dl`` over all entries (per-program partials summed in a fixed order: deterministic; or fp32
atomics into one buffer). Softmax statistics are recomputed in backward (the
pooling reads each input once; recomputation is cheaper than saving the ``[Tc, 2m, c]`` weights).

Schedule: the softmax runs over the slot axis, which is never a tensor axis: every tensor is a ``[BLOCK_C]``
channel vector with a fixed number of channels per thread (<= 4, the same for the bf16 and the fp32 loads, so
no layout conversions), slots are a loop, and all softmax math is per thread (no shared memory, no barriers).
A program owns ``BLOCK_C`` channels of ``PER_PROG`` consecutive entries (its first entry's document found by a
binary search over ``cu_seqlens_c``, then walked forward entry by entry); ``PER_PROG`` grows with the input so
that about two waves of resident programs remain. Two slot schedules:

* held (``2m`` slots with overlap, else ``m``, at most 8: CSA / indexer ratio 4): the slots are unrolled and
  kept in registers (max, then one ``exp`` per slot, as the reference); in backward ``dape`` is accumulated in
  registers over the program's entries and added with one (vector) atomic per (slot, channel) per program.
* streamed (more slots: HCA ratio 128): a dynamic loop over steps of ``UNROLL`` slots (``32 / cpt``, the tail
  masked) with an online softmax (running max, denominator and numerator, rescaled once per step); backward
  makes a second pass over the slots for the stores and adds ``dape`` with one atomic per (entry, slot,
  channel).

Memory bound: it reads ``kv`` and ``score`` once and writes ``[Tc, c]`` fp32 (backward: ``dkv``, ``dscore``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from csa_kernels._triton_utils import check_triton_device, interpreting
from csa_kernels.ops.compressor.launch_config import device_limits, launch_config


@triton.jit
def _doc_of(CUC, e, N_DOCS, SEARCH_STEPS):
    """Document ``d`` of entry ``e``: binary search of ``cu_seqlens_c[d] <= e < cu_seqlens_c[d+1]`` (empty
    documents never match)."""
    lo = e * 0  # int scalar
    hi = lo + N_DOCS - 1
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        go = tl.load(CUC + mid) <= e
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    return lo


@triton.jit
def _load_slot(KV, SCORE, row, chh, mask, stride_kv, stride_sc):
    """``kv`` and ``score`` of one slot (row ``row``, channels ``chh``), both ``[BLOCK_C]`` fp32, 0 where masked."""
    v = tl.load(KV + row * stride_kv + chh, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(SCORE + row * stride_sc + chh, mask=mask, other=0.0).to(tl.float32)
    return v, s


@triton.jit
def _stream_stats(
    KV, SCORE, APE, r, chh, mask, live, m, den, num, stride_kv, stride_sc, stride_ape, RATIO, UNROLL
):
    """Online softmax statistics ``(max, denominator, numerator)`` updated with the ``RATIO`` slots of one half
    (rows ``r ..``, channels ``chh``); ``live`` false: the half is empty (weight 0)."""
    for j0 in range(0, RATIO, UNROLL):
        vs = ()
        ls = ()
        for jj in tl.static_range(UNROLL):
            ok = (j0 + jj) < RATIO
            msk = mask & ok & live
            v, s = _load_slot(KV, SCORE, r + j0 + jj, chh, msk, stride_kv, stride_sc)
            a = tl.load(APE + (j0 + jj) * stride_ape + chh, mask=msk, other=0.0)
            vs = vs + (v,)
            ls = ls + (tl.where(ok & live, s + a, -float("inf")),)
        m_new = m
        for jj in tl.static_range(UNROLL):
            m_new = tl.maximum(m_new, ls[jj])
        m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)  # all slots so far empty: keep exp finite
        scale = tl.exp(m - m_ref)
        den = den * scale
        num = num * scale
        for jj in tl.static_range(UNROLL):
            p = tl.exp(ls[jj] - m_ref)
            den += p
            num += p * vs[jj]
        m = m_new
    return m, den, num


@triton.jit
def _zero_rows(DKV, DSCORE, start, stop, chh, mask, stride_dkv, stride_dsc, BLOCK_C: tl.constexpr):
    """``dkv = dscore = 0`` on rows ``start .. stop - 1`` (int64), channels ``chh``: rows no slot reads."""
    z_kv = tl.zeros([BLOCK_C], dtype=DKV.dtype.element_ty)
    z_sc = tl.zeros([BLOCK_C], dtype=DSCORE.dtype.element_ty)
    for r in range(start, stop):
        tl.store(DKV + r * stride_dkv + chh, z_kv, mask=mask)
        tl.store(DSCORE + r * stride_dsc + chh, z_sc, mask=mask)


@triton.jit
def _stream_grads(
    KV, SCORE, APE, DKV, DSCORE, DAPE, r, chh, mask, live, m, inv, pooled, g,
    stride_kv, stride_sc, stride_ape, stride_dkv, stride_dsc, RATIO, UNROLL,
):  # fmt: skip
    """Second backward pass over the slots of one half: ``dkv``, ``dscore`` stores and ``dape`` atomics."""
    for j0 in range(0, RATIO, UNROLL):
        for jj in tl.static_range(UNROLL):
            j = j0 + jj
            msk = mask & (j < RATIO) & live
            v, s = _load_slot(KV, SCORE, r + j, chh, msk, stride_kv, stride_sc)
            a = tl.load(APE + j * stride_ape + chh, mask=msk, other=0.0)
            ag = tl.where(msk, tl.exp(s + a - m) * inv, 0.0) * g
            dl = ag * (v - pooled)
            tl.store(DKV + (r + j) * stride_dkv + chh, ag.to(DKV.dtype.element_ty), mask=msk)
            tl.store(DSCORE + (r + j) * stride_dsc + chh, dl.to(DSCORE.dtype.element_ty), mask=msk)
            tl.atomic_add(DAPE + j * stride_ape + chh, dl, mask=msk, sem="relaxed")


@triton.jit
def _zero_unread_rows(
    CU, CUC, DKV, DSCORE, e_first, e_stop, doc, ch, ch_own, mc,
    stride_dkv, stride_dsc, N_DOCS, RATIO: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Zero ``dkv`` / ``dscore`` on the rows (and halves) that no slot of the entries ``e_first .. e_stop - 1`` reads
    and that no other program owns: before the first entry's document (entry 0), and after each document's last
    entry: the prev half of its block (overlap), its tail and the following documents without a complete block."""
    c1 = tl.load(CUC + doc + 1)
    for i in range(0, e_stop - e_first):
        e = e_first + i
        while c1 <= e:
            doc += 1
            c1 = tl.load(CUC + doc + 1)
        if e == 0:
            r0 = tl.load(CU + doc).to(tl.int64)  # first row of the first document with an entry
            _zero_rows(DKV, DSCORE, r0 * 0, r0, ch_own, mc, stride_dkv, stride_dsc, BLOCK_C)
            if OVERLAP:
                _zero_rows(DKV, DSCORE, r0 * 0, r0, ch, mc, stride_dkv, stride_dsc, BLOCK_C)
        if e == c1 - 1:  # last entry of its document
            c0 = tl.load(CUC + doc)
            r1 = tl.load(CU + doc).to(tl.int64) + (e - c0 + 1).to(tl.int64) * RATIO  # end of its block
            if OVERLAP:
                _zero_rows(DKV, DSCORE, r1 - RATIO, r1, ch, mc, stride_dkv, stride_dsc, BLOCK_C)
            d2 = doc + 1  # the next document with an entry (N_DOCS: none)
            nxt = tl.load(CUC + tl.minimum(d2 + 1, N_DOCS))
            while (d2 < N_DOCS) & (nxt <= e + 1):
                d2 += 1
                nxt = tl.load(CUC + tl.minimum(d2 + 1, N_DOCS))
            gap_end = tl.load(CU + d2).to(tl.int64)
            _zero_rows(DKV, DSCORE, r1, gap_end, ch_own, mc, stride_dkv, stride_dsc, BLOCK_C)
            if OVERLAP:
                _zero_rows(DKV, DSCORE, r1, gap_end, ch, mc, stride_dkv, stride_dsc, BLOCK_C)


@triton.jit(do_not_specialize=["TC", "N_DOCS", "SEARCH_STEPS", "PER_PROG"])
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
    stride_dape_prog,
    TC,
    C,
    C_OFF,
    N_DOCS,
    SEARCH_STEPS,
    PER_PROG,
    RATIO: tl.constexpr,
    OVERLAP: tl.constexpr,
    BACKWARD: tl.constexpr,
    HELD: tl.constexpr,
    UNROLL: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TC_ON_DEVICE: tl.constexpr = False,
):
    e_first = tl.program_id(0) * PER_PROG
    e_stop = tl.minimum(e_first + PER_PROG, TC)
    if TC_ON_DEVICE:  # static SeqBoundaries: TC is the capacity, the real entry count is cu_seqlens_c[-1]
        e_stop = tl.minimum(e_stop, tl.load(CUC + N_DOCS))
    # deterministic mode: each program adds dape into its own partial (stride_dape_prog > 0; only this program's
    # threads, each its own (slot, channel), touch it, in program order), summed in a fixed order on the host side
    DAPE += tl.program_id(0).to(tl.int64) * stride_dape_prog
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C] prev-half / output channels
    mc = ch < C
    ch_own = ch + C_OFF  # own-half channels: [c, 2c) when overlapping, [0, c) otherwise
    NS: tl.constexpr = 2 * RATIO if OVERLAP else RATIO  # slots per entry

    doc_first = _doc_of(CUC, e_first, N_DOCS, SEARCH_STEPS)
    doc = doc_first
    c0 = tl.load(CUC + doc)  # first entry of the document
    c1 = tl.load(CUC + doc + 1)  # first entry of the next one
    row0 = tl.load(CU + doc).to(tl.int64)  # first row of the document

    dape = ()  # held backward: this program's dape partial sums per slot (own half, then prev half)
    if HELD and BACKWARD:
        for _ in tl.static_range(NS):
            dape = dape + (tl.zeros([BLOCK_C], dtype=tl.float32),)

    for i in range(0, e_stop - e_first):
        e = e_first + i  # (a tensor also under the interpreter)
        while c1 <= e:  # next non-empty document
            doc += 1
            c0 = c1
            c1 = tl.load(CUC + doc + 1)
            row0 = tl.load(CU + doc).to(tl.int64)
        w = e - c0  # block index in the document (0: no previous half)
        has_prev = w > 0
        r0 = row0 + w.to(tl.int64) * RATIO  # first row of the own block
        r_prev = tl.maximum(r0 - RATIO, 0)  # first row of the previous block (clamped; masked when w = 0)
        m_prev = mc & has_prev
        o_off = e.to(tl.int64) * stride_o
        if HELD:
            vs = ()  # values of the NS slots (own half, then prev half), [BLOCK_C] fp32 each
            ls = ()  # their logits (ape re-read per entry from L1: holding it costs 8 registers per channel)
            for k in tl.static_range(NS):
                if k < RATIO:
                    v, s = _load_slot(KV, SCORE, r0 + k, ch_own, mc, stride_kv, stride_sc)
                    ls = ls + (s + tl.load(APE + k * stride_ape + ch_own, mask=mc, other=0.0),)
                else:
                    v, s = _load_slot(KV, SCORE, r_prev + (k - RATIO), ch, m_prev, stride_kv, stride_sc)
                    a = tl.load(APE + (k - RATIO) * stride_ape + ch, mask=m_prev, other=0.0)
                    ls = ls + (tl.where(has_prev, s + a, -float("inf")),)
                vs = vs + (v,)
            mx = ls[0]  # own slots are never empty: finite
            for k in tl.static_range(1, NS):
                mx = tl.maximum(mx, ls[k])
            ps = ()
            den = tl.zeros([BLOCK_C], dtype=tl.float32)
            num = tl.zeros([BLOCK_C], dtype=tl.float32)
            for k in tl.static_range(NS):
                p = tl.exp(ls[k] - mx)
                ps = ps + (p,)
                den += p
                num += p * vs[k]
            inv = 1.0 / den
            pooled = num * inv
            if not BACKWARD:
                tl.store(OUT + o_off + ch, pooled, mask=mc)
            else:
                g = tl.load(DOUT + o_off + ch, mask=mc, other=0.0).to(tl.float32)
                acc = ()
                for k in tl.static_range(NS):
                    ag = ps[k] * inv * g  # dv; 0 for empty slots and masked channels
                    dl = ag * (vs[k] - pooled)
                    if k < RATIO:
                        tl.store(DKV + (r0 + k) * stride_dkv + ch_own, ag.to(DKV.dtype.element_ty), mask=mc)
                        tl.store(
                            DSCORE + (r0 + k) * stride_dsc + ch_own, dl.to(DSCORE.dtype.element_ty), mask=mc
                        )
                    else:
                        rk = r_prev + (k - RATIO)
                        tl.store(DKV + rk * stride_dkv + ch, ag.to(DKV.dtype.element_ty), mask=m_prev)
                        tl.store(DSCORE + rk * stride_dsc + ch, dl.to(DSCORE.dtype.element_ty), mask=m_prev)
                    acc = acc + (dape[k] + dl,)
                dape = acc
        else:
            mx = tl.full([BLOCK_C], -float("inf"), dtype=tl.float32)
            den = tl.zeros([BLOCK_C], dtype=tl.float32)
            num = tl.zeros([BLOCK_C], dtype=tl.float32)
            own = w >= 0  # always true
            mx, den, num = _stream_stats(
                KV,
                SCORE,
                APE,
                r0,
                ch_own,
                mc,
                own,
                mx,
                den,
                num,
                stride_kv,
                stride_sc,
                stride_ape,
                RATIO,
                UNROLL,
            )
            if OVERLAP:
                mx, den, num = _stream_stats(
                    KV, SCORE, APE, r_prev, ch, mc, has_prev, mx, den, num,
                    stride_kv, stride_sc, stride_ape, RATIO, UNROLL,
                )  # fmt: skip
            inv = 1.0 / den
            pooled = num * inv
            if not BACKWARD:
                tl.store(OUT + o_off + ch, pooled, mask=mc)
            else:
                g = tl.load(DOUT + o_off + ch, mask=mc, other=0.0).to(tl.float32)
                _stream_grads(
                    KV, SCORE, APE, DKV, DSCORE, DAPE, r0, ch_own, mc, own, mx, inv, pooled, g,
                    stride_kv, stride_sc, stride_ape, stride_dkv, stride_dsc, RATIO, UNROLL,
                )  # fmt: skip
                if OVERLAP:
                    _stream_grads(
                        KV, SCORE, APE, DKV, DSCORE, DAPE, r_prev, ch, mc, has_prev, mx, inv, pooled, g,
                        stride_kv, stride_sc, stride_ape, stride_dkv, stride_dsc, RATIO, UNROLL,
                    )  # fmt: skip

    if HELD and BACKWARD:
        for k in tl.static_range(NS):
            if k < RATIO:
                tl.atomic_add(DAPE + k * stride_ape + ch_own, dape[k], mask=mc, sem="relaxed")
            else:
                tl.atomic_add(DAPE + (k - RATIO) * stride_ape + ch, dape[k], mask=mc, sem="relaxed")

    if BACKWARD:
        # rows no slot reads get zero gradients (dkv / dscore are not pre-zeroed): a second, light walk
        _zero_unread_rows(
            CU, CUC, DKV, DSCORE, e_first, e_stop, doc_first, ch, ch_own, mc,
            stride_dkv, stride_dsc, N_DOCS, RATIO, OVERLAP, BLOCK_C,
        )  # fmt: skip


_RESIDENT: dict[tuple, int] = {}  # launch key -> programs resident on the whole GPU at once


def _resident_programs(args: tuple, meta: dict, key: tuple, limits: tuple[int, int, int]) -> int:
    """How many programs of this compiled variant fit on the GPU at once (from its register count)."""
    if key not in _RESIDENT:
        kernel = _compressor_pool_kernel.warmup(*args, grid=(1,), **meta)
        kernel._init_handles()
        sms, regs_sm, threads_sm = limits
        threads = 32 * meta["num_warps"]
        regs = -(-max(kernel.n_regs, 1) // 8) * 8 * threads  # allocation granularity: 8 registers per thread
        per_sm = max(1, min(regs_sm // regs, threads_sm // threads, 32))
        _RESIDENT[key] = sms * per_sm
    return _RESIDENT[key]


def _launch(
    kv,
    score,
    ape,
    cu,
    cuc,
    tc,
    ratio,
    overlap,
    out,
    dout=None,
    dkv=None,
    dscore=None,
    dape=None,
    deterministic=False,
    tc_on_device=False,
):
    """One launch of ``cdiv(Tc, PER_PROG)`` x ``cdiv(c, BLOCK_C)`` programs. ``PER_PROG`` (consecutive entries per
    program) is as large as leaves about two waves of the programs the GPU holds at once (from the compiled
    kernel's register count), so the hardware scheduler still balances the tail while backward's ``dape``
    atomics (one per (slot, channel) per program on the held schedule) shrink with larger inputs.

    ``deterministic`` (backward): every program adds ``dape`` into its own fp32 partial ``[ratio, Dk]``; the
    partials are summed in program order into ``dape`` (bitwise reproducible; no two programs share an address)."""
    n_docs = cu.shape[0] - 1
    c = kv.shape[1] // 2 if overlap else kv.shape[1]
    backward = dout is not None
    interp = interpreting()
    index = kv.device.index if kv.device.index is not None else 0
    limits = (1, 0, 0) if interp else device_limits(index)
    held, unroll, block_c, warps = launch_config(ratio, overlap, c, tc, limits[0])
    n_cb = triton.cdiv(c, block_c)
    dummy = out if out is not None else dout
    args = [
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
        0,  # stride_dape_prog, set below
        tc,
        c,
        c if overlap else 0,
        n_docs,
        max(1, n_docs).bit_length(),
        1,  # PER_PROG, set below
    ]
    meta = dict(
        RATIO=ratio,
        OVERLAP=overlap,
        BACKWARD=backward,
        HELD=held,
        UNROLL=unroll,
        BLOCK_C=block_c,
        TC_ON_DEVICE=tc_on_device,
        num_warps=warps,
        num_stages=1,
    )
    if interp:
        per_prog = 3  # several entries per program: exercises the document walk and the dape partial sums
    else:
        key = (kv.device.index, kv.dtype, score.dtype, *meta.values())
        resident_e = max(1, _resident_programs(tuple(args), meta, key, limits) // n_cb)  # entries in flight
        per_prog = max(1, tc // (2 * resident_e))
    args[-1] = per_prog
    n_prog = triton.cdiv(tc, per_prog)
    part = None
    if backward and deterministic:
        part = torch.zeros((n_prog, *dape.shape), dtype=torch.float32, device=dape.device)
        args[9] = part
        args[16] = part.stride(0)
    _compressor_pool_kernel[(n_prog, n_cb)](*args, **meta)
    if part is not None:
        dape.copy_(part.sum(0))


def compressor_pool_fwd(
    kv, score, ape, cu, cuc, tc: int, ratio: int, overlap: bool, tc_on_device: bool = False
) -> torch.Tensor:
    """``pooled [Tc, c]`` fp32 (inputs contiguous in the channel dim; ``ape`` fp32; ``cu``, ``cuc`` int32 on the
    device, ``tc`` their entry count). ``tc_on_device`` (static SeqBoundaries): ``tc`` is a capacity, the kernel
    reads the real count ``cuc[-1]`` on the device and the rows past it stay zero."""
    check_triton_device(kv, score, ape)
    c = kv.shape[1] // 2 if overlap else kv.shape[1]
    alloc = torch.zeros if tc_on_device else torch.empty
    out = alloc((tc, c), dtype=torch.float32, device=kv.device)
    if tc and c:
        _launch(kv, score, ape, cu, cuc, tc, ratio, overlap, out, tc_on_device=tc_on_device)
    return out


def compressor_pool_bwd(
    kv,
    score,
    ape,
    cu,
    cuc,
    tc: int,
    ratio: int,
    overlap: bool,
    dout: torch.Tensor,
    deterministic: bool = True,
    tc_on_device: bool = False,
):
    """``(dkv [T, Dk] kv.dtype, dscore [T, Dk] score.dtype, dape [ratio, Dk] fp32)``.

    ``deterministic`` (default): ``dape`` from per-program partials summed in a fixed order (bitwise
    reproducible; costs one ``[programs, ratio, Dk]`` fp32 buffer and a small sum) instead of shared fp32 atomics
    (``False``, kept for comparison). ``dkv`` / ``dscore`` are plain stores, deterministic either way.

    The kernel writes every row of ``dkv`` / ``dscore`` (zeros where no slot reads the row), so they start
    uninitialised unless there is no entry at all. ``tc_on_device``: as in :func:`compressor_pool_fwd` (the
    gradient buffers start at zero: with no real entry the kernel writes no row).
    """
    dape = torch.zeros(ape.shape, dtype=torch.float32, device=ape.device)
    if not (tc and kv.shape[1]):
        return torch.zeros_like(kv), torch.zeros_like(score), dape
    dkv = torch.zeros_like(kv) if tc_on_device else _grad_buffer(kv)
    dscore = torch.zeros_like(score) if tc_on_device else _grad_buffer(score)
    _launch(
        kv, score, ape, cu, cuc, tc, ratio, overlap, None, dout.contiguous(), dkv, dscore, dape, deterministic,
        tc_on_device,
    )  # fmt: skip
    return dkv, dscore, dape


def _grad_buffer(t: torch.Tensor) -> torch.Tensor:
    """Uninitialised gradient buffer like ``t`` (tests poison it to check that the kernel writes every row)."""
    return torch.empty_like(t)
