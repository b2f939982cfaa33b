"""Small-M routed experts in Triton: only the weights of experts that have rows are read (decode, issue 37).

Rows are sorted by expert (``counts [G]`` rows each, starting at ``Σ_{j<e} counts[j]``). The grid has ``S = min(M,
G)`` static expert slots (at most ``M`` experts have rows), so it is CUDA-graph capturable with no host sync; slot
``s`` belongs to the ``s``-th expert with rows (ascending), which each program finds itself from the ``[G]`` counts
(:func:`_slot_expert`: one cumulative sum over ``G``, no separate launches). Program ``(s, n)`` takes that expert
``e`` and output columns ``[n·BN, (n+1)·BN)``; it loops over its expert's rows in blocks of ``BM`` and reads its
weight tile once per row block. A slot with no expert (fewer than ``S`` experts have rows) does no work (zero trips)
and reads no weight. Per row ``r`` of expert ``e``:

```
_routed_mm_kernel:        out[r, n]  = Σ_k x[r, k] · w[e, n, k]                                   (fp32 accumulate)
_routed_gate_up_kernel:   a = round(Σ_k x[r, k] · gate_up[e, n, k]),  b = round(Σ_k x[r, k] · gate_up[e, F + n, k])
                          h[r, n] = silu(min(a, L)) · clamp(b, -L, L) · p[r]                        (fp32 math)
```

``round`` is the cast to the input dtype and back (the grouped path stores ``x @ gate_up.T`` in the input dtype
before its SwiGLU), so the fused gate-up kernel makes the same roundings as
:func:`hash_moe.experts.grouped_swiglu_experts`. fp32 operands multiply in IEEE fp32 (no TF32). ``UPCAST`` (the
interpreter, whose bf16 / fp16 ``tl.dot`` is wrong) multiplies bf16 / fp16 tiles in fp32 (IEEE): exact products,
as the GPU's tensor cores; its fp32 -> bf16 cast truncates, so there
(``ROUND_BF16_BY_BITS``) the fc1 rounding is done on the bits (nearest, ties to even).

Shape legend: ``M`` rows, ``G`` experts (``G_BLOCK``: the next power of two), ``S`` expert slots, ``K`` input width, ``N`` output width, ``F`` expert width.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _slot_expert(counts_ptr, n_experts, G_BLOCK: tl.constexpr):
    """``(e, start, count)`` of this program's slot ``s = program_id(0)``: the ``s``-th expert with rows, its first
    row and its row count; ``count = 0`` (no work) when fewer than ``s + 1`` experts have rows."""
    g = tl.arange(0, G_BLOCK)  # [G]
    counts = tl.load(counts_ptr + g, mask=g < n_experts, other=0).to(tl.int32)  # [G]
    active = counts > 0
    rank = tl.cumsum(active.to(tl.int32), 0) - 1  # [G] position among the experts with rows
    mine = active & (rank == tl.program_id(0))  # [G]: one True, or none
    e = tl.sum(tl.where(mine, g, 0))
    count = tl.sum(tl.where(mine, counts, 0))
    start = tl.sum(tl.where(g < e, counts, 0).to(tl.int64))
    return e.to(tl.int64), start, count


@triton.jit
def _routed_mm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    counts_ptr,
    n_experts,
    n_out,
    n_in,
    stride_x,
    stride_we,
    stride_wn,
    stride_out,
    G_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    e, start, count = _slot_expert(counts_ptr, n_experts, G_BLOCK)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    col_ok = cols < n_out
    w_rows = w_ptr + e * stride_we + cols[:, None].to(tl.int64) * stride_wn  # [BN, 1]
    for m0 in range(0, count, BLOCK_M):
        local = m0 + tl.arange(0, BLOCK_M)  # [BM]
        row_ok = local < count
        rows = start + local.to(tl.int64)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, n_in, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
            k_ok = ks < n_in
            xt = tl.load(
                x_ptr + rows[:, None] * stride_x + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )  # [BM, BK]
            wt = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, BK]
            if UPCAST:  # the interpreter's bf16 / fp16 tl.dot is wrong: multiply in fp32 there
                xt, wt = xt.to(tl.float32), wt.to(tl.float32)
            if IEEE:
                acc += tl.dot(xt, tl.trans(wt), input_precision="ieee")
            else:
                acc += tl.dot(xt, tl.trans(wt))
        out_offs = rows[:, None] * stride_out + cols[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _routed_gate_up_kernel(
    x_ptr,
    w_ptr,
    p_ptr,
    h_ptr,
    counts_ptr,
    n_experts,
    n_ffn,
    n_in,
    stride_x,
    stride_we,
    stride_wn,
    stride_h,
    limit,
    G_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    ROUND_BF16_BY_BITS: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    HAS_PROBS: tl.constexpr,
):
    e, start, count = _slot_expert(counts_ptr, n_experts, G_BLOCK)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] columns of h (rows n of w1, F + n of w3)
    col_ok = cols < n_ffn
    gate_rows = w_ptr + e * stride_we + cols[:, None].to(tl.int64) * stride_wn  # [BN, 1]
    up_rows = gate_rows + n_ffn * stride_wn
    for m0 in range(0, count, BLOCK_M):
        local = m0 + tl.arange(0, BLOCK_M)  # [BM]
        row_ok = local < count
        rows = start + local.to(tl.int64)
        acc_a = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, n_in, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
            k_ok = ks < n_in
            w_mask = col_ok[:, None] & k_ok[None, :]
            xt = tl.load(
                x_ptr + rows[:, None] * stride_x + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )  # [BM, BK]
            wa = tl.load(gate_rows + ks[None, :], mask=w_mask, other=0.0)  # [BN, BK]
            wb = tl.load(up_rows + ks[None, :], mask=w_mask, other=0.0)  # [BN, BK]
            if UPCAST:  # the interpreter's bf16 / fp16 tl.dot is wrong: multiply in fp32 there
                xt, wa, wb = xt.to(tl.float32), wa.to(tl.float32), wb.to(tl.float32)
            if IEEE:
                acc_a += tl.dot(xt, tl.trans(wa), input_precision="ieee")
                acc_b += tl.dot(xt, tl.trans(wb), input_precision="ieee")
            else:
                acc_a += tl.dot(xt, tl.trans(wa))
                acc_b += tl.dot(xt, tl.trans(wb))
        # the grouped path stores x @ gate_up.T in the input dtype before its SwiGLU: same rounding here
        if (
            ROUND_BF16_BY_BITS
        ):  # nearest bf16, ties to even, on the bits (finite values; inline: no jit helper,
            # which the interpreter would turn into an InterpretedFunction that an sm_90 compile cannot reference)
            ua = acc_a.to(tl.uint32, bitcast=True)
            ub = acc_b.to(tl.uint32, bitcast=True)
            a = ((ua + 0x7FFF + ((ua >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            b = ((ub + 0x7FFF + ((ub >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        else:
            a = acc_a.to(x_ptr.dtype.element_ty).to(tl.float32)
            b = acc_b.to(x_ptr.dtype.element_ty).to(tl.float32)
        if HAS_LIMIT:
            a = tl.minimum(a, limit, propagate_nan=tl.PropagateNan.ALL)
            b = tl.maximum(b, -limit, propagate_nan=tl.PropagateNan.ALL)
            b = tl.minimum(b, limit, propagate_nan=tl.PropagateNan.ALL)
        h = a / (1.0 + tl.exp(-a)) * b  # [BM, BN] fp32
        if HAS_PROBS:
            h = h * tl.load(p_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        h_offs = rows[:, None] * stride_h + cols[None, :]
        tl.store(h_ptr + h_offs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
