"""Fused clamped SwiGLU (§7.3, P5) in Triton: one pass forward, one pass backward, fp32 math.

Implements, per row ``m`` and column ``f`` (reference: :func:`hash_moe.swiglu.clamped_swiglu_ref`):

```
a' = min(a, L)            b' = clamp(b, -L, L)          # [a | b] = gate_up[m]; L = None: no clamp
h  = silu(a') · b' · p                                    # p = probs[m] (1 without probs)

dp = Σ_f dh · silu(a') · b'                               # per row, reduced inside the backward kernel
da = dh · p · b' · σ(a') · (1 + a' · (1 - σ(a')))  · [a <= L]
db = dh · p · silu(a')                              · [-L <= b <= L]
```

The clamp gradients are ``torch.clamp``'s: pass-through where the value lies inside the closed interval. The
forward reads ``gate_up [M, 2F]`` and ``probs [M]`` once and writes ``h [M, F]``; the backward reads ``gate_up``,
``probs`` and ``dh`` once and writes ``d gate_up [M, 2F]`` and ``d probs [M]``. Outputs take the input dtypes
(``h`` and ``d gate_up``: ``gate_up.dtype``; ``d probs``: ``probs.dtype``). fp64 inputs never come here (the
PyTorch path keeps fp64 math).

Shape legend: ``M`` rows (tokens, or token-expert pairs), ``F`` expert width.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _clamp_swiglu_inputs(a, b, limit, HAS_LIMIT: tl.constexpr):
    if HAS_LIMIT:
        a = tl.minimum(a, limit, propagate_nan=tl.PropagateNan.ALL)
        b = tl.maximum(b, -limit, propagate_nan=tl.PropagateNan.ALL)
        b = tl.minimum(b, limit, propagate_nan=tl.PropagateNan.ALL)
    return a, b


@triton.jit
def _swiglu_fwd_kernel(
    x_ptr,
    p_ptr,
    h_ptr,
    n_rows,
    n_cols,
    stride_x,
    stride_h,
    limit,
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    HAS_PROBS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)  # [BF]
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    x_row = x_ptr + rows[:, None].to(tl.int64) * stride_x
    a = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # [BM, BF] gate
    b = tl.load(x_row + n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # [BM, BF] up
    a, b = _clamp_swiglu_inputs(a, b, limit, HAS_LIMIT)
    h = a / (1.0 + tl.exp(-a)) * b
    if HAS_PROBS:
        h = h * tl.load(p_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    h_offs = rows[:, None].to(tl.int64) * stride_h + cols[None, :]
    tl.store(h_ptr + h_offs, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    x_ptr,
    p_ptr,
    g_ptr,
    dx_ptr,
    dp_ptr,
    n_rows,
    n_cols,
    stride_x,
    stride_g,
    stride_dx,
    limit,
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    NEED_DPROBS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    row_ok = rows < n_rows
    rows64 = rows[:, None].to(tl.int64)
    x_row = x_ptr + rows64 * stride_x
    g_row = g_ptr + rows64 * stride_g
    dx_row = dx_ptr + rows64 * stride_dx
    if HAS_PROBS:
        p = tl.load(p_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]  # [BM, 1]
    dp = tl.zeros([BLOCK_M], dtype=tl.float32)
    for f0 in range(0, n_cols, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)  # [BF]
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        a = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # [BM, BF]
        b = tl.load(x_row + n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        a_c, b_c = _clamp_swiglu_inputs(a, b, limit, HAS_LIMIT)
        sig = 1.0 / (1.0 + tl.exp(-a_c))
        silu = a_c * sig
        if NEED_DPROBS:
            dp += tl.sum(g * silu * b_c, axis=1)
        if HAS_PROBS:
            g = g * p
        da = g * b_c * sig * (1.0 + a_c * (1.0 - sig))
        db = g * silu
        if HAS_LIMIT:
            # multiplied (not selected) like the PyTorch path, so a NaN gradient stays NaN
            da = da * (a <= limit).to(tl.float32)
            db = db * ((b >= -limit) & (b <= limit)).to(tl.float32)
        tl.store(dx_row + cols[None, :], da.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_row + n_cols + cols[None, :], db.to(dx_ptr.dtype.element_ty), mask=mask)
    if NEED_DPROBS:
        tl.store(dp_ptr + rows, dp.to(dp_ptr.dtype.element_ty), mask=row_ok)


# GPU tiles: 2048 elements per tile and 4 warps = 16 elements (two 128-bit bf16 vectors) per thread and tensor.
_TILE = 2048
_MAX_BLOCK_F = 1024
_NUM_WARPS = 4


def _blocks(n_rows: int, n_cols: int, interpret: bool) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_F)``: GPU tiles of ``_TILE`` elements; the interpreter takes whole (small) problems."""
    block_f = min(_MAX_BLOCK_F, triton.next_power_of_2(n_cols))
    tile = 1 << 16 if interpret else _TILE
    block_m = max(1, min(tile // block_f, triton.next_power_of_2(max(n_rows, 1))))
    return block_m, block_f


def _interpreting(t: torch.Tensor) -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1" or not t.is_cuda


def _store_dtype(dtype: torch.dtype, interpret: bool) -> torch.dtype:
    """Dtype of the kernel's output buffers: the interpreter truncates fp32 -> bf16 stores (the GPU rounds to
    nearest even), so when interpreting the kernels write fp32 and PyTorch rounds to ``dtype`` afterwards."""
    return torch.float32 if interpret and dtype in (torch.bfloat16, torch.float16) else dtype


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as ``[M, width]`` with a unit column stride (a copy only when it has none)."""
    t = t.reshape(
        t.shape[:-1].numel(), width
    )  # explicit row count: reshape(-1, 0) is ambiguous when width == 0
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch_fwd(x: torch.Tensor, probs: torch.Tensor | None, limit: float | None) -> torch.Tensor:
    m, f = x.shape[0], x.shape[1] // 2
    interpret = _interpreting(x)
    h = torch.empty(m, f, device=x.device, dtype=_store_dtype(x.dtype, interpret))  # [M, F]
    if m == 0 or f == 0:
        return h.to(x.dtype)
    block_m, block_f = _blocks(m, f, interpret)
    grid = (triton.cdiv(m, block_m), triton.cdiv(f, block_f))
    _swiglu_fwd_kernel[grid](
        x,
        probs if probs is not None else x,
        h,
        m,
        f,
        x.stride(0),
        h.stride(0),
        float(limit) if limit is not None else 0.0,
        BLOCK_M=block_m,
        BLOCK_F=block_f,
        HAS_LIMIT=limit is not None,
        HAS_PROBS=probs is not None,
        num_warps=_NUM_WARPS,
    )
    return h.to(x.dtype)


def _launch_bwd(
    x: torch.Tensor, probs: torch.Tensor | None, g: torch.Tensor, limit: float | None, need_dprobs: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    m, f = x.shape[0], x.shape[1] // 2
    interpret = _interpreting(x)
    dx = torch.empty(m, 2 * f, device=x.device, dtype=_store_dtype(x.dtype, interpret))  # [M, 2F]
    dp = None
    if need_dprobs:
        dp = torch.empty(m, device=x.device, dtype=_store_dtype(probs.dtype, interpret))  # [M]
    if m == 0 or f == 0:
        return dx.to(x.dtype), (dp.zero_().to(probs.dtype) if dp is not None else None)
    block_m, block_f = _blocks(m, f, interpret)
    _swiglu_bwd_kernel[(triton.cdiv(m, block_m),)](
        x,
        probs if probs is not None else x,
        g,
        dx,
        dp if dp is not None else dx,
        m,
        f,
        x.stride(0),
        g.stride(0),
        dx.stride(0),
        float(limit) if limit is not None else 0.0,
        BLOCK_M=block_m,
        BLOCK_F=block_f,
        HAS_LIMIT=limit is not None,
        HAS_PROBS=probs is not None,
        NEED_DPROBS=need_dprobs,
        num_warps=_NUM_WARPS,
    )
    return dx.to(x.dtype), (dp.to(probs.dtype) if dp is not None else None)


class _FusedClampedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, probs: torch.Tensor | None, limit: float | None) -> torch.Tensor:
        width = gate_up.shape[-1]
        x = _rows(gate_up.detach(), width)  # [M, 2F]
        p = probs.detach().reshape(-1).contiguous() if probs is not None else None  # [M]
        h = _launch_fwd(x, p, limit)  # [M, F]
        ctx.save_for_backward(gate_up, probs)
        ctx.limit = limit
        return h.reshape(*gate_up.shape[:-1], width // 2)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate_up, probs = ctx.saved_tensors
        width = gate_up.shape[-1]
        x = _rows(gate_up.detach(), width)
        p = probs.detach().reshape(-1).contiguous() if probs is not None else None
        g = _rows(grad_out, width // 2)  # [M, F]
        need_dprobs = probs is not None and ctx.needs_input_grad[1]
        dx, dp = _launch_bwd(x, p, g, ctx.limit, need_dprobs)
        dx = dx.reshape(gate_up.shape)
        dp = dp.reshape(probs.shape) if dp is not None else None
        return dx, dp, None


def fused_clamped_swiglu(
    gate_up: torch.Tensor, limit: float | None, probs: torch.Tensor | None = None
) -> torch.Tensor:
    """Fused clamped SwiGLU: ``[..., 2F]`` (``[gate | up]``) and ``probs [...]`` -> ``[..., F]`` in ``gate_up.dtype``.

    Differentiable in ``gate_up`` and ``probs``. Inputs are validated by the caller
    (:func:`hash_moe.swiglu.clamped_swiglu` with ``backend="triton"``); fp64 is not supported here.
    """
    return _FusedClampedSwiGLU.apply(gate_up, probs, limit)
