"""Fused Triton kernels of RMSNorm over the last dim of a contiguous ``[R, D]`` view (forward and backward).

Math (fp32 in registers, whatever the storage dtypes; see :func:`dsv4_primitives.rmsnorm.reference.rms_norm_ref`):

    rstd = 1 / sqrt(sum(x^2) / D + eps)                 # [R]   saved for the backward (4 bytes per row)
    xhat = x * rstd                                      # [R, D]
    y    = xhat * w            (y = xhat without weight)
    g    = dy * w              (g = dy without weight)
    dx   = rstd * (g - xhat * sum(g * xhat) / D)
    dw   = sum_rows(dy * xhat)

Forward: one program normalises ``BLOCK_R`` rows; a row up to ``BLOCK_D`` wide is one register tile, so ``x`` is read
once and ``y`` written once (``SINGLE_TILE``). Wider rows loop over ``BLOCK_D`` chunks twice (sum of squares, then
scale), re-reading ``x`` (from L2 for rows of a few 10 KiB).

Backward: reads ``x``, ``dy``, ``rstd`` once and writes ``dx`` once. The weight gradient is reduced without atomics:
program ``p`` walks the row blocks ``p, p + P, p + 2P, ...`` (``P = num_programs``), accumulates
``sum(dy * xhat)`` of its rows in an fp32 ``[BLOCK_D]`` register vector and writes it to row ``p`` of an fp32
``[P, D]`` partial-sum buffer, which the caller sums over ``P``. Chunked (wide) rows accumulate into the program's
own row of that buffer instead (read-add-write, no other program touches it; the buffer starts zeroed).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_fwd_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    R,
    D,
    eps,
    HAS_W: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINGLE_TILE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    rmask = rows < R
    base = rows[:, None] * D  # [BR, 1] element offsets of the row starts (int64)
    if SINGLE_TILE:
        cols = tl.arange(0, BLOCK_D)  # [BD]
        cmask = cols < D
        m = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + base + cols[None, :], mask=m, other=0.0).to(tl.float32)  # [BR, BD]
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)  # [BR]
        y = x * rstd[:, None]
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)  # [BD]
            y = y * w[None, :]
        tl.store(y_ptr + base + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)
    else:
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for c0 in range(0, D, BLOCK_D):
            cols = c0 + tl.arange(0, BLOCK_D)
            m = rmask[:, None] & (cols < D)[None, :]
            x = tl.load(x_ptr + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / D + eps)  # [BR]
        for c0 in range(0, D, BLOCK_D):
            cols = c0 + tl.arange(0, BLOCK_D)
            cmask = cols < D
            m = rmask[:, None] & cmask[None, :]
            x = tl.load(x_ptr + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
            y = x * rstd[:, None]
            if HAS_W:
                w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
                y = y * w[None, :]
            tl.store(y_ptr + base + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)


@triton.jit
def rms_norm_bwd_kernel(
    x_ptr,
    w_ptr,
    dy_ptr,
    rstd_ptr,
    dx_ptr,
    dw_part_ptr,
    R,
    D,
    n_blocks,
    HAS_W: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINGLE_TILE: tl.constexpr,
):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    part = dw_part_ptr + pid.to(tl.int64) * D  # this program's row of the [P, D] partial sums
    if SINGLE_TILE:
        cols = tl.arange(0, BLOCK_D)  # [BD]
        cmask = cols < D
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)  # [BD]
        dw_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for blk in range(pid, n_blocks, n_prog):
            rows = (blk * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BR]
            rmask = rows < R
            m = rmask[:, None] & cmask[None, :]
            offs = rows[:, None] * D + cols[None, :]  # [BR, BD]
            x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)  # [BR]
            xhat = x * rstd[:, None]
            if HAS_W:
                g = dy * w[None, :]
            else:
                g = dy
            c = tl.sum(g * xhat, axis=1) / D  # [BR]
            dx = (g - xhat * c[:, None]) * rstd[:, None]
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=m)
            if COMPUTE_DW:
                dw_acc += tl.sum(dy * xhat, axis=0)
        if COMPUTE_DW:
            tl.store(part + cols, dw_acc, mask=cmask)
    else:
        for blk in range(pid, n_blocks, n_prog):
            rows = (blk * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
            rmask = rows < R
            base = rows[:, None] * D
            rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
            acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
            for c0 in range(0, D, BLOCK_D):
                cols = c0 + tl.arange(0, BLOCK_D)
                cmask = cols < D
                m = rmask[:, None] & cmask[None, :]
                x = tl.load(x_ptr + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
                g = tl.load(dy_ptr + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
                if HAS_W:
                    g = g * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
                acc += g * x
            c = tl.sum(acc, axis=1) * rstd / D  # [BR] mean(g * xhat)
            for c0 in range(0, D, BLOCK_D):
                cols = c0 + tl.arange(0, BLOCK_D)
                cmask = cols < D
                m = rmask[:, None] & cmask[None, :]
                x = tl.load(x_ptr + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
                xhat = x * rstd[:, None]
                if HAS_W:
                    g = dy * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
                else:
                    g = dy
                dx = (g - xhat * c[:, None]) * rstd[:, None]
                tl.store(dx_ptr + base + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)
                if COMPUTE_DW:
                    p = tl.load(part + cols, mask=cmask, other=0.0)
                    tl.store(part + cols, p + tl.sum(dy * xhat, axis=0), mask=cmask)
