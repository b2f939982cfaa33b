"""Autograd binding of the fused compressor pooling kernels (``compressor_pool_triton``)."""

from __future__ import annotations

import torch

from csa_kernels.ops.compressor.checks import check_compress_inputs, check_pool_inputs
from csa_kernels.ops.compressor.reference import (
    _norm_rope_cached,
    compressed_positions,
    max_entry_position,
)
from csa_kernels.ops.compressor.triton import compressor_pool_bwd, compressor_pool_fwd
from dsv4_primitives import RopeConfig
from dsv4_primitives.varlen import SeqBoundaries


class CompressorPoolTritonFunction(torch.autograd.Function):
    """pooled = pool(kv, score, ape); saves the inputs and recomputes the softmax weights in backward.

    ``tc_on_device``: ``tc`` is a capacity and the real entry count is read on the device from ``cuc`` (static
    :class:`~dsv4_primitives.varlen.SeqBoundaries`, the CUDA-graph mode)."""

    @staticmethod
    def forward(ctx, kv, score, ape, cu, cuc, tc, ratio, overlap, tc_on_device=False):
        ape32 = ape.float().contiguous()
        pooled = compressor_pool_fwd(kv, score, ape32, cu, cuc, tc, ratio, overlap, tc_on_device=tc_on_device)
        ctx.save_for_backward(kv, score, ape32, cu, cuc)
        ctx.tc, ctx.ratio, ctx.overlap, ctx.ape_dtype = tc, ratio, overlap, ape.dtype
        ctx.tc_on_device = tc_on_device
        return pooled

    @staticmethod
    def backward(ctx, dpooled):
        kv, score, ape32, cu, cuc = ctx.saved_tensors
        dkv, dscore, dape = compressor_pool_bwd(
            kv, score, ape32, cu, cuc, ctx.tc, ctx.ratio, ctx.overlap, dpooled, tc_on_device=ctx.tc_on_device
        )
        return dkv, dscore, dape.to(ctx.ape_dtype), None, None, None, None, None, None


def compressor_pool_triton(
    kv: torch.Tensor,  # [T, Dk]
    score: torch.Tensor,  # [T, Dk]
    ape: torch.Tensor,  # [ratio, Dk]
    ratio: int,
    overlap: bool,
    bounds: SeqBoundaries,
) -> tuple[torch.Tensor, SeqBoundaries]:
    """Fused Triton form of :func:`~csa_kernels.ops.compressor.reference.compressor_pool_ref`.

    Same contract and validation; math in fp32 (fp64 inputs are computed in fp32 too), ``pooled [Tc, c]`` fp32,
    differentiable in ``kv``, ``score`` and ``ape`` (gradients in their own dtypes). No device -> host sync. Static
    boundaries: one grid over the entry capacity ``T // ratio`` whose programs past the real count (read on the
    device) do nothing; the padding rows are zero and get no gradient.
    """
    check_pool_inputs(kv, score, ape, ratio, overlap, bounds)
    bounds_c = bounds.compressed(ratio)  # [N+1] int32 on the device (a cached constant in host mode)
    cu = bounds.cu_seqlens
    cu_dev = cu if cu.dtype == torch.int32 else cu.to(torch.int32)
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    score = score if score.stride(-1) == 1 else score.contiguous()
    pooled = CompressorPoolTritonFunction.apply(
        kv, score, ape, cu_dev, bounds_c.cu_seqlens, bounds_c.total, ratio, overlap, bounds.is_static
    )
    return pooled, bounds_c


def compress_triton(
    x: torch.Tensor,  # [T, d]
    wkv: torch.Tensor,  # [Dk, d]
    wgate: torch.Tensor,  # [Dk, d]
    ape: torch.Tensor,  # [ratio, Dk]
    norm_weight: torch.Tensor,  # [c]
    ratio: int,
    overlap: bool,
    rope_cfg: RopeConfig,
    bounds: SeqBoundaries,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, SeqBoundaries]:
    """Full compressor with the fused pooling kernel: ``(entries [Tc, c] in x.dtype, bounds.compressed(ratio))``.

    Projections run as GEMMs in ``x.dtype`` (bf16 on GPU: fp32 accumulation, bf16 ``kv`` / ``score``), pooling in
    the Triton kernel (fp32 softmax), RMSNorm and RoPE on the fp32 pooled rows as in :func:`compress_ref` (RoPE from
    the cached tables of ``dsv4_primitives``: same values, no per-call upload).
    """
    check_compress_inputs(x, wkv, wgate, ape, norm_weight, ratio, overlap, rope_cfg)
    kv = torch.nn.functional.linear(x, wkv.to(x.dtype))  # [T, Dk]
    score = torch.nn.functional.linear(x, wgate.to(x.dtype))  # [T, Dk]
    pooled, bounds_c = compressor_pool_triton(kv, score, ape, ratio, overlap, bounds)  # [Tc, c] fp32
    positions = compressed_positions(bounds, ratio)  # [Tc]
    max_pos = max_entry_position(bounds, ratio)
    rotated = _norm_rope_cached(pooled, norm_weight, eps, positions, rope_cfg, max_pos)
    return rotated.to(x.dtype), bounds_c
