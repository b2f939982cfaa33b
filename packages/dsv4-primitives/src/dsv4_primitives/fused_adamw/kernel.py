"""The Triton kernel of :mod:`dsv4_primitives.fused_adamw`: one pass of clip + AdamW + bf16 copy over a pointer table.

One program updates ``BLOCK`` consecutive elements of one tensor. Its tensor index and first element come from the
block table (``block_tensor`` [B] int32, ``block_start`` [B] int64); the tensor's addresses from the pointer table
``addr`` [5, N] int64 (rows: main param, grad, exp_avg, exp_avg_sq, model-param copy), its length from ``numel``
[N] int64 and its scalars from ``hyper`` [N, 8] fp32 (:data:`HYPER_COLUMNS`). The update, in torch's single-tensor
AdamW order (``torch/optim/adamw.py`` / ``adam.py``, ``_single_tensor_adam``), every operation rounded to fp32:

    g  = grad * clip                                   (clip: the device scalar at ``clip_ptr``)
    p  = p * (1 - lr wd)                               (decoupled weight decay)
    m  = m + w1 (g - m)           if w1 < 0.5          (torch.lerp(m, g, w1), w1 = 1 - beta1)
         g - (g - m) (1 - w1)     otherwise
    v  = v * beta2;  v = v + ((1 - beta2) g) g         (mul_ then addcmul_)
    p  = p - (lr / bc1) (m / (sqrt(v) / sqrt(bc2) + eps))   (addcdiv_; bc_k = 1 - beta_k^step)
    model = bf16(p)                                    (round to nearest even, on the bits; only when HAS_DST)

``sqrt`` and both divisions are the IEEE round-to-nearest ones (``sqrt_rn`` / ``div_rn``); multiply-adds may be
contracted by the compiler on the GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

# columns of the per-tensor scalar table
HYPER_COLUMNS = ("decay", "w1", "beta2", "w2", "step_size", "bc2_sqrt", "eps", "unused")


@triton.jit
def adamw_pointer_table_kernel(
    addr_ptr,  # [5, N] int64: main param, grad, exp_avg, exp_avg_sq, model copy (0 when absent)
    n_tensors,
    numel_ptr,  # [N] int64
    hyper_ptr,  # [N, 8] fp32 (HYPER_COLUMNS)
    block_tensor_ptr,  # [B] int32
    block_start_ptr,  # [B] int64
    clip_ptr,  # [1] fp32
    G_DTYPE: tl.constexpr,
    DST_DTYPE: tl.constexpr,
    HAS_DST: tl.constexpr,
    DST_BF16: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(block_tensor_ptr + pid).to(tl.int64)
    start = tl.load(block_start_ptr + pid)
    numel = tl.load(numel_ptr + t)
    p_ptr = tl.load(addr_ptr + t).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(addr_ptr + n_tensors + t).to(tl.pointer_type(G_DTYPE))
    m_ptr = tl.load(addr_ptr + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(addr_ptr + 3 * n_tensors + t).to(tl.pointer_type(tl.float32))
    d_addr = tl.load(addr_ptr + 4 * n_tensors + t)
    if ALIGNED:
        # the host put here only tensors whose addresses are 16-byte aligned and whose sizes are multiples of 8:
        # the hints let the compiler use 16-byte vector loads / stores (addresses from a table are otherwise of
        # unknown alignment, and a mask against an unknown size is per element)
        numel = tl.multiple_of(numel, 8)
        start = tl.multiple_of(start, BLOCK)
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
    offs = start + tl.arange(0, BLOCK)  # [BLOCK]
    mask = offs < numel

    decay = tl.load(hyper_ptr + 8 * t + 0)
    w1 = tl.load(hyper_ptr + 8 * t + 1)
    beta2 = tl.load(hyper_ptr + 8 * t + 2)
    w2 = tl.load(hyper_ptr + 8 * t + 3)
    step_size = tl.load(hyper_ptr + 8 * t + 4)
    bc2_sqrt = tl.load(hyper_ptr + 8 * t + 5)
    eps = tl.load(hyper_ptr + 8 * t + 6)
    clip = tl.load(clip_ptr)

    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * clip
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)

    p = p * decay
    diff = g - m
    m = tl.where(w1 < 0.5, m + w1 * diff, g - diff * (1.0 - w1))
    v = v * beta2
    v = v + (w2 * g) * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)

    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_DST:
        if DST_BF16:
            # round to nearest even on the bits (what torch's fp32 -> bf16 copy does; the interpreter's own
            # fp32 -> bf16 cast truncates), NaN -> the canonical quiet NaN
            bits = p.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rounded = tl.where(p != p, 0x7FC0, rounded)
            d16_ptr = d_addr.to(tl.pointer_type(tl.uint16))
            if ALIGNED:
                d16_ptr = tl.multiple_of(d16_ptr, 16)
            tl.store(d16_ptr + offs, rounded.to(tl.uint16), mask=mask)
        else:
            d_ptr = d_addr.to(tl.pointer_type(DST_DTYPE))
            if ALIGNED:
                d_ptr = tl.multiple_of(d_ptr, 16)
            tl.store(d_ptr + offs, p.to(DST_DTYPE), mask=mask)
