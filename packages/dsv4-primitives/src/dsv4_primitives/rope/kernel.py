"""Fused Triton kernel for partial interleaved RoPE (forward, inverse and backward share it).

The input is a ``[N, H, D]`` view with unit channel stride (``N`` positions, ``H`` heads of ``[nope | rope]``
channels, ``rope`` = the last ``r`` channels). A program owns a ``[BLOCK_P, BLOCK_H]`` tile of (position, head)
rows:

* the rope slice ``[D - r, D)`` of every row is loaded as one contiguous ``[BLOCK_P, BLOCK_H, BLOCK_ROPE]`` tile
  (16-byte vector loads when ``D - r``, the strides and the base are 16-byte aligned), converted to fp32 and split
  into its even/odd channels in registers (``reshape`` to ``[..., BLOCK_ROPE / 2, 2]`` + ``split``);
* ``cos``/``sin`` of ``|pos|`` are gathered once per position from the cached fp32 ``[L, r/2]`` tables as a
  ``[BLOCK_P, 1, BLOCK_ROPE / 2]`` tile and broadcast over the ``BLOCK_H`` heads of that position (``sin`` is
  negated for negative positions and for the inverse rotation);
* the rotated pairs are interleaved back (``join`` + ``reshape``) and stored contiguously in the output dtype.

Out of place (``COPY_NOPE``) the same program also copies the ``D - r`` leading channels of its rows with one wide
masked ``[BLOCK_P, BLOCK_H, BLOCK_NOPE]`` tile (bit-identical: loaded and stored in the storage dtype, never
converted), issuing both loads before either store, so the whole op is a single read of ``x`` and a single write
of ``y``. In place the nope channels are not touched: the kernel moves only ``r / D`` of the tensor.

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
    N,
    H,
    stride_xn,
    stride_xh,
    stride_yn,
    stride_yh,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_ROPE: tl.constexpr,
    BLOCK_NOPE: tl.constexpr,
    COPY_NOPE: tl.constexpr,
    INVERSE: tl.constexpr,
):
    HALF: tl.constexpr = ROPE // 2
    BLOCK_HALF: tl.constexpr = BLOCK_ROPE // 2
    p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)  # [BP] positions
    h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH] heads
    pmask = p < N
    hmask = h < H
    rmask = pmask[:, None, None] & hmask[None, :, None]  # [BP, BH, 1]
    xrow = x_ptr + (p * stride_xn)[:, None, None] + (h * stride_xh)[None, :, None]  # [BP, BH, 1] row starts
    yrow = y_ptr + (p * stride_yn)[:, None, None] + (h * stride_yh)[None, :, None]

    k = tl.arange(0, BLOCK_ROPE)[None, None, :]  # [1, 1, BRO] rope channel
    kmask = rmask & (k < ROPE)
    v = tl.load(xrow + NOPE + k, mask=kmask, other=0.0)  # [BP, BH, BRO] storage dtype
    if COPY_NOPE:
        j = tl.arange(0, BLOCK_NOPE)[None, None, :]  # [1, 1, BNO] nope channel
        jmask = rmask & (j < NOPE)
        w = tl.load(xrow + j, mask=jmask)  # [BP, BH, BNO], copied bit for bit

    pos = tl.load(pos_ptr + p, mask=pmask, other=0)[:, None, None]  # [BP, 1, 1] int64
    apos = tl.where(pos < 0, -pos, pos)
    sign = tl.where(pos < 0, -1.0, 1.0)
    if INVERSE:
        sign = -sign
    i = tl.arange(0, BLOCK_HALF)[None, None, :]  # [1, 1, BHA] pair index
    tab = apos * HALF + i  # [BP, 1, BHA]
    tmask = pmask[:, None, None] & (i < HALF)
    c = tl.load(cos_ptr + tab, mask=tmask, other=1.0)  # [BP, 1, BHA] fp32, shared by the BH heads
    s = tl.load(sin_ptr + tab, mask=tmask, other=0.0) * sign

    a, b = tl.split(
        tl.reshape(v.to(tl.float32), [BLOCK_P, BLOCK_H, BLOCK_HALF, 2])
    )  # [BP, BH, BHA] even, odd
    ya = a * c - b * s
    yb = a * s + b * c
    out = tl.reshape(tl.join(ya, yb), [BLOCK_P, BLOCK_H, BLOCK_ROPE])  # [BP, BH, BRO] interleaved again

    if COPY_NOPE:
        tl.store(yrow + j, w, mask=jmask)
    tl.store(yrow + NOPE + k, out.to(y_ptr.dtype.element_ty), mask=kmask)
