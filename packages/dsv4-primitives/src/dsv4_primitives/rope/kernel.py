"""Fused Triton kernel for partial interleaved RoPE (forward, inverse and backward share it).

One program rotates ``BLOCK_R`` rows of a ``[N, H, D]`` view (row = one head of one position). For each row it
gathers ``cos``/``sin`` of ``|pos|`` from the cached fp32 tables (``sin`` is negated for negative positions and for
the inverse rotation), loads the even/odd channels of the rope part ``[D - r, D)`` as two strided tiles, rotates
them in fp32 and stores them in the output dtype. Out of place (``COPY_NOPE``), the ``D - r`` leading channels are
copied unchanged (bit-identical); in place they are not touched at all, so the in-place kernel moves only
``r / D`` of the tensor.

The backward of a rotation by ``+pos`` is the rotation by ``-pos`` (the Jacobian is orthogonal), so the same kernel
with ``INVERSE`` flipped computes the gradient.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_rotate_kernel(
    x_ptr,
    y_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    R,
    H,
    stride_xn,
    stride_xh,
    stride_yn,
    stride_yh,
    NOPE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_NOPE: tl.constexpr,
    COPY_NOPE: tl.constexpr,
    INVERSE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    rmask = rows < R
    n = rows // H
    h = rows - n * H
    pos = tl.load(pos_ptr + n, mask=rmask, other=0).to(tl.int64)  # [BR]
    apos = tl.where(pos < 0, -pos, pos)
    sign = tl.where(pos < 0, -1.0, 1.0)
    if INVERSE:
        sign = -sign

    i = tl.arange(0, BLOCK_HALF)  # [BH]
    m2 = rmask[:, None] & (i < HALF)[None, :]
    tab = apos[:, None] * HALF + i[None, :]
    c = tl.load(cos_ptr + tab, mask=m2, other=1.0)  # [BR, BH] fp32
    s = tl.load(sin_ptr + tab, mask=m2, other=0.0) * sign[:, None]

    xrow = x_ptr + n * stride_xn + h * stride_xh  # [BR] pointers to the head start
    yrow = y_ptr + n * stride_yn + h * stride_yh
    pa = xrow[:, None] + (NOPE + 2 * i)[None, :]
    a = tl.load(pa, mask=m2, other=0.0).to(tl.float32)
    b = tl.load(pa + 1, mask=m2, other=0.0).to(tl.float32)
    ya = a * c - b * s
    yb = a * s + b * c
    qa = yrow[:, None] + (NOPE + 2 * i)[None, :]
    tl.store(qa, ya.to(y_ptr.dtype.element_ty), mask=m2)
    tl.store(qa + 1, yb.to(y_ptr.dtype.element_ty), mask=m2)

    if COPY_NOPE:
        for c0 in tl.static_range(0, NOPE, BLOCK_NOPE):
            j = c0 + tl.arange(0, BLOCK_NOPE)
            mj = rmask[:, None] & (j < NOPE)[None, :]
            v = tl.load(xrow[:, None] + j[None, :], mask=mj)
            tl.store(yrow[:, None] + j[None, :], v, mask=mj)
