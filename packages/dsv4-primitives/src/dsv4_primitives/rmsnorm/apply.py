"""Public, dispatching RMSNorm: ``rms_norm`` (autograd, fused Triton forward and backward).

Same math and dtypes as :func:`dsv4_primitives.rmsnorm.reference.rms_norm_ref` (see its docstring): fp32 math,
output in ``x.dtype``, optional ``[D]`` weight of any floating dtype (fp32 keep-in-fp32 params with bf16 ``x`` are
the training case), weight gradient accumulated in fp32 and returned in the weight's dtype. The Triton path reads
``x`` once and writes ``y`` once in the forward, saving only ``rstd`` (fp32, one value per row) besides ``x``; the
backward reads ``x``, ``dy`` and ``rstd`` once and writes ``dx``, with the weight gradient reduced through
per-program partial sums (:mod:`dsv4_primitives.rmsnorm.kernel`).
"""

from __future__ import annotations

import functools

import torch

from dsv4_primitives.dispatch import resolve_backend
from dsv4_primitives.rmsnorm.kernel import rms_norm_bwd_kernel, rms_norm_fwd_kernel
from dsv4_primitives.rmsnorm.reference import rms_norm_ref

MAX_TILE_D = 8192  # widest row held in registers as one tile (one read of x); wider rows loop over chunks
CHUNK_D = 4096  # chunk width of the looping path
_TILE_ELEMS_CUDA = 4096  # elements of one program's [BLOCK_R, BLOCK_D] tile on CUDA
_TILE_ELEMS_INTERPRET = 16384  # interpreter: few, large programs
_INTERPRET_BWD_PROGRAMS = 4  # interpreter: a few persistent programs (exercises the partial-sum reduction)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _launch_config(rows: int, d: int, is_cuda: bool) -> tuple[int, int, bool, int]:
    """``(BLOCK_R, BLOCK_D, SINGLE_TILE, num_warps)`` for ``rows`` rows of width ``d``."""
    single = d <= MAX_TILE_D
    block_d = _next_pow2(d) if single else min(CHUNK_D, _next_pow2(d))
    tile = _TILE_ELEMS_CUDA if is_cuda else _TILE_ELEMS_INTERPRET
    block_r = max(1, min(_next_pow2(max(rows, 1)), tile // block_d))
    num_warps = min(16, max(1, block_r * block_d // 512)) if is_cuda else 1  # ~16 fp32 values per thread
    return block_r, block_d, single, num_warps


def rms_norm_fwd_triton(
    x2: torch.Tensor, weight: torch.Tensor | None, eps: float, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward on a contiguous ``x2 [R, D]``: returns ``y [R, D]`` (``x2.dtype``; written into the contiguous
    ``out [R, D]`` when given) and ``rstd [R]`` (fp32)."""
    rows, d = x2.shape
    y = torch.empty_like(x2) if out is None else out
    rstd = torch.empty(rows, dtype=torch.float32, device=x2.device)
    if rows == 0:
        return y, rstd
    block_r, block_d, single, num_warps = _launch_config(rows, d, x2.is_cuda)
    grid = (_cdiv(rows, block_r),)
    rms_norm_fwd_kernel[grid](
        x2,
        weight if weight is not None else x2,  # dummy pointer, never read without HAS_W
        y,
        rstd,
        rows,
        d,
        float(eps),
        HAS_W=weight is not None,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        SINGLE_TILE=single,
        num_warps=num_warps,
    )
    return y, rstd


def rms_norm_bwd_triton(
    x2: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    dy2: torch.Tensor,
    compute_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Backward on contiguous ``x2, dy2 [R, D]``: ``dx [R, D]`` (``x2.dtype``) and ``dw [D]`` (weight dtype) or None."""
    rows, d = x2.shape
    dx = torch.empty_like(x2)
    compute_dw = compute_dw and weight is not None
    if rows == 0:
        return dx, (torch.zeros_like(weight) if compute_dw else None)
    block_r, block_d, single, num_warps = _launch_config(rows, d, x2.is_cuda)
    n_blocks = _cdiv(rows, block_r)
    if not compute_dw:
        n_prog = n_blocks
    elif (
        x2.is_cuda
    ):  # persistent programs, one partial-sum row each: 16 warps per SM (what 100-112 regs allow)
        n_prog = min(n_blocks, _sm_count(x2.device.index or 0) * max(1, 16 // num_warps))
    else:
        n_prog = min(n_blocks, _INTERPRET_BWD_PROGRAMS)
    if compute_dw:
        alloc = torch.empty if single else torch.zeros  # the chunked path accumulates in place
        dw_part = alloc((n_prog, d), dtype=torch.float32, device=x2.device)  # [P, D]
    else:
        dw_part = rstd  # dummy pointer, never written without COMPUTE_DW
    rms_norm_bwd_kernel[(n_prog,)](
        x2,
        weight if weight is not None else x2,
        dy2,
        rstd,
        dx,
        dw_part,
        rows,
        d,
        n_blocks,
        HAS_W=weight is not None,
        COMPUTE_DW=compute_dw,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        SINGLE_TILE=single,
        num_warps=num_warps,
    )
    dw = dw_part.sum(0).to(weight.dtype) if compute_dw else None
    return dx, dw


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        d = x.shape[-1]
        x2 = x.reshape(-1, d).contiguous()  # [R, D]
        w = weight.contiguous() if weight is not None else None
        # the output is allocated in x's shape (not a view of a [R, D] buffer), so callers may modify it in place
        # (e.g. an in-place RoPE of the normalised q): autograd forbids in-place writes to views made inside a
        # custom Function
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _, rstd = rms_norm_fwd_triton(x2, w, eps, out=y.view(-1, d))
        ctx.save_for_backward(x2, w, rstd)
        ctx.x_shape = x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, w, rstd = ctx.saved_tensors
        dy2 = dy.reshape(x2.shape).contiguous()  # [R, D]
        dx2, dw = rms_norm_bwd_triton(x2, w, rstd, dy2, ctx.needs_input_grad[1])
        dx = dx2.view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        return dx, dw, None


def _check_inputs(x: torch.Tensor, weight: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise ValueError(f"rms_norm needs a floating-point tensor x, got {getattr(x, 'dtype', type(x))}")
    if x.dim() < 1:
        raise ValueError(
            "rms_norm needs x with at least one dim (normalised over the last dim), got a scalar"
        )
    if weight is None:
        return
    if not isinstance(weight, torch.Tensor) or not weight.dtype.is_floating_point:
        raise ValueError(
            f"rms_norm weight must be a floating-point tensor or None, got {type(weight).__name__}"
        )
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight shape {tuple(weight.shape)} must be [{x.shape[-1]}] (the last dim of x)")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}; move the weight to x.device")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *, backend: str = "auto"
) -> torch.Tensor:
    """RMSNorm over the last dim (differentiable w.r.t. ``x`` and ``weight``): ``w * x / sqrt(mean(x^2) + eps)``.

    Args:
        x: ``[..., D]`` bf16 / fp16 / fp32 (any leading shape, zero rows allowed, any strides; non-contiguous
            inputs are copied to a contiguous buffer first). fp64 inputs always take the reference (fp64 math).
        weight: ``[D]`` or ``None`` (weightless, e.g. the per-head query norm); any floating dtype, loaded as fp32.
        eps: added to the mean square.
        backend: ``"auto"`` (Triton for CUDA tensors, the reference otherwise; the environment variables
            ``DSV4_PRIMITIVES_BACKEND`` / ``DSV4_BACKEND`` override it, see :mod:`dsv4_primitives.dispatch`),
            ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``) or ``"reference"`` (:func:`rms_norm_ref`).
    Returns:
        ``[..., D]`` in ``x.dtype``; math in fp32; the weight gradient is accumulated in fp32 and returned in
        ``weight.dtype``.
    """
    _check_inputs(x, weight)
    resolved = resolve_backend(backend, x, op="dsv4_primitives.rms_norm")
    if resolved == "reference" or x.dtype == torch.float64 or x.shape[-1] == 0:
        return rms_norm_ref(x, weight, eps)
    return _RMSNormFunction.apply(x, weight, float(eps))
