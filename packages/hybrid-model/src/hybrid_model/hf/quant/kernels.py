"""Triton kernels dequantizing the released FP8 / FP4 weights (math: :mod:`hybrid_model.hf.quant.reference`).

Both read the codes as raw bytes and build each float32 value from its bit fields (exact, no table, no fp8 load
support needed, so they also run in the Triton interpreter):

    e4m3 byte b: sign b >> 7, exponent e = (b >> 3) & 15, mantissa m = b & 7
        e > 0: bits(sign << 31 | (e + 120) << 23 | m << 20)        = (1 + m/8) * 2**(e - 7)
        e = 0: m * 2**-9 (subnormal)      b & 0x7F = 0x7F: NaN
    e2m1 code c: sign c >> 3, exponent e = (c >> 1) & 3, mantissa m = c & 1
        e > 0: bits(sign << 31 | (e + 126) << 23 | m << 22)        = (1 + m/2) * 2**(e - 1)
        e = 0: m * 0.5

One program writes a ``[BLOCK_R, BLOCK_C]`` tile of the output; scales are float32 (the caller converts ue8m0),
gathered per element from the block grid, so any block shape and partial edge blocks work.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e4m3_to_f32(b):
    b = b.to(tl.int32)
    sign = (b >> 7) & 1
    e = (b >> 3) & 15
    m = b & 7
    normal = (sign << 31) | ((e + 120) << 23) | (m << 20)
    val = tl.where(e > 0, normal.to(tl.float32, bitcast=True), m.to(tl.float32) * 0.001953125)
    val = tl.where((sign == 1) & (e == 0), -val, val)
    return tl.where((b & 127) == 127, float("nan"), val)


@triton.jit
def _e2m1_to_f32(c):
    sign = (c >> 3) & 1
    e = (c >> 1) & 3
    m = c & 1
    normal = (sign << 31) | ((e + 126) << 23) | (m << 22)
    val = tl.where(e > 0, normal.to(tl.float32, bitcast=True), m.to(tl.float32) * 0.5)
    return tl.where((sign == 1) & (e == 0), -val, val)


@triton.jit
def dequant_fp8_kernel(
    q_ptr,  # uint8 view of the e4m3 codes [M, N]
    s_ptr,  # float32 [ceil(M/BM), ceil(N/BN)]
    out_ptr,  # [M, N]
    M,
    N,
    stride_q,
    stride_s,
    stride_o,
    QBM: tl.constexpr,
    QBN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    b = tl.load(q_ptr + rows[:, None] * stride_q + cols[None, :], mask=mask, other=0)
    s = tl.load(s_ptr + (rows[:, None] // QBM) * stride_s + cols[None, :] // QBN, mask=mask, other=1.0)
    w = _e4m3_to_f32(b) * s
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dequant_fp4_kernel(
    p_ptr,  # uint8 [M, KH] (two codes per byte, low nibble first)
    s_ptr,  # float32 [M, ceil(2 KH / GROUP)]
    out_ptr,  # [M, 2 KH]
    M,
    KH,
    stride_p,
    stride_s,
    stride_o,
    GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # byte columns
    mask = (rows[:, None] < M) & (cols[None, :] < KH)
    b = tl.load(p_ptr + rows[:, None] * stride_p + cols[None, :], mask=mask, other=0).to(tl.int32)  # [BR, BC]
    # the two nibbles side by side, low first: output columns 2c, 2c + 1 of byte c, one contiguous row per tile
    w = tl.reshape(
        tl.join(_e2m1_to_f32(b & 15), _e2m1_to_f32((b >> 4) & 15)), (BLOCK_R, 2 * BLOCK_C)
    )  # [BR, 2 BC]
    out_cols = tl.program_id(1) * (2 * BLOCK_C) + tl.arange(0, 2 * BLOCK_C)
    out_mask = (rows[:, None] < M) & (out_cols[None, :] < 2 * KH)
    s = tl.load(s_ptr + rows[:, None] * stride_s + out_cols[None, :] // GROUP, mask=out_mask, other=1.0)
    w = w * s
    tl.store(
        out_ptr + rows[:, None] * stride_o + out_cols[None, :], w.to(out_ptr.dtype.element_ty), mask=out_mask
    )
