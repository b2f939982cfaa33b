"""Dequantization entry points: the Triton kernel (:mod:`.kernels`) on CUDA, the fp32 reference (:mod:`.reference`)
elsewhere (``backend="auto" | "triton" | "reference"``, the workspace dispatch rule; variable ``HYBRID_MODEL_BACKEND``)."""

from __future__ import annotations

import torch

from dsv4_primitives.dispatch import resolve_backend
from hybrid_model.hf.quant.formats import FP4_STORAGE, cdiv, scale_to_float
from hybrid_model.hf.quant.kernels import dequant_fp4_kernel, dequant_fp8_kernel
from hybrid_model.hf.quant.reference import dequantize_fp4_ref, dequantize_fp8_ref

_BLOCK_R, _BLOCK_C = 32, 128


def dequantize_fp8(
    q: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """FP8 block-scaled ``q [M, N]`` -> ``[M, N]`` in ``dtype`` (:func:`~.reference.dequantize_fp8_ref`)."""
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"an FP8 weight must be float8_e4m3fn, got {q.dtype}")
    if resolve_backend(backend, q, op="hybrid_model.dequantize_fp8") == "reference":
        return dequantize_fp8_ref(q, scale, block, dtype)
    m, n = q.shape
    if tuple(scale.shape) != (cdiv(m, block[0]), cdiv(n, block[1])):
        return dequantize_fp8_ref(q, scale, block, dtype)  # raises the shape error
    qb = q.contiguous().view(torch.uint8)
    s = scale_to_float(scale).contiguous()
    out = torch.empty(m, n, dtype=dtype, device=q.device)
    grid = (cdiv(m, _BLOCK_R), cdiv(n, _BLOCK_C))
    dequant_fp8_kernel[grid](
        qb, s, out, m, n, qb.stride(0), s.stride(0), out.stride(0),
        QBM=block[0], QBN=block[1], BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C,
    )  # fmt: skip
    return out


def dequantize_fp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    group: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """FP4 ``packed [M, K/2]`` with group scales -> ``[M, K]`` in ``dtype`` (:func:`~.reference.dequantize_fp4_ref`)."""
    if packed.dtype not in FP4_STORAGE:
        raise ValueError(f"an FP4 weight must be stored as one of {FP4_STORAGE}, got {packed.dtype}")
    if resolve_backend(backend, packed, op="hybrid_model.dequantize_fp4") == "reference":
        return dequantize_fp4_ref(packed, scale, group, dtype)
    m, kh = packed.shape
    if tuple(scale.shape) != (m, cdiv(2 * kh, group)):
        return dequantize_fp4_ref(packed, scale, group, dtype)  # raises the shape error
    pb = packed.contiguous().view(torch.uint8)
    s = scale_to_float(scale).contiguous()
    out = torch.empty(m, 2 * kh, dtype=dtype, device=packed.device)
    grid = (cdiv(m, _BLOCK_R), cdiv(kh, _BLOCK_C))
    dequant_fp4_kernel[grid](
        pb, s, out, m, kh, pb.stride(0), s.stride(0), out.stride(0),
        GROUP=group, BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C,
    )  # fmt: skip
    return out
