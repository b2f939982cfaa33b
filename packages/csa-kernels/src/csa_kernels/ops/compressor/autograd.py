"""Autograd binding of the fused compressor pooling kernels (``compressor_pool_triton``)."""

from __future__ import annotations

import torch

from csa_kernels.ops.compressor.checks import check_compress_inputs, check_pool_inputs
from csa_kernels.ops.compressor.reference import (
    _norm_rope_cached,
    compressed_positions_host,
    max_entry_position,
)
from csa_kernels.ops.compressor.triton import compressor_pool_bwd, compressor_pool_fwd
from dsv4_primitives import RopeConfig
from dsv4_primitives.varlen import compressed_cu_seqlens_host, upload_host_ints


class CompressorPoolTritonFunction(torch.autograd.Function):
    """pooled = pool(kv, score, ape); saves the inputs and recomputes the softmax weights in backward.

    ``tc_on_device``: ``tc`` is a capacity and the real entry count is read on the device from ``cuc`` (the
    static-bounds / CUDA-graph form, :mod:`csa_kernels.ops.compressor.static`)."""

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
    cu_seqlens: torch.Tensor,  # [N+1]
    *,
    cu_seqlens_host: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused Triton form of :func:`~csa_kernels.ops.compressor.reference.compressor_pool_ref`.

    Same contract and validation; math in fp32 (fp64 inputs are computed in fp32 too), ``pooled [Tc, c]`` fp32,
    differentiable in ``kv``, ``score`` and ``ape`` (gradients in their own dtypes). Without ``cu_seqlens_host``
    the validation reads ``cu_seqlens`` back (one device -> host sync); with it, none.
    """
    cu = check_pool_inputs(kv, score, ape, ratio, overlap, cu_seqlens, cu_seqlens_host)  # host list
    cuc_list = compressed_cu_seqlens_host(cu, ratio)
    cuc = upload_host_ints(cuc_list, kv.device)  # [N+1], non-blocking
    cu_dev = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    score = score if score.stride(-1) == 1 else score.contiguous()
    pooled = CompressorPoolTritonFunction.apply(kv, score, ape, cu_dev, cuc, cuc_list[-1], ratio, overlap)
    return pooled, cuc


def compress_triton(
    x: torch.Tensor,  # [T, d]
    wkv: torch.Tensor,  # [Dk, d]
    wgate: torch.Tensor,  # [Dk, d]
    ape: torch.Tensor,  # [ratio, Dk]
    norm_weight: torch.Tensor,  # [c]
    ratio: int,
    overlap: bool,
    rope_cfg: RopeConfig,
    cu_seqlens: torch.Tensor,
    eps: float = 1e-6,
    *,
    cu_seqlens_host: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full compressor with the fused pooling kernel: ``(entries [Tc, c] in x.dtype, cu_seqlens_c)``.

    Projections run as GEMMs in ``x.dtype`` (bf16 on GPU: fp32 accumulation, bf16 ``kv`` / ``score``), pooling in
    the Triton kernel (fp32 softmax), RMSNorm and RoPE on the fp32 pooled rows as in :func:`compress_ref` (RoPE from
    the cached tables of ``dsv4_primitives``: same values, no per-call upload).
    """
    check_compress_inputs(x, wkv, wgate, ape, norm_weight, ratio, overlap, rope_cfg)
    kv = torch.nn.functional.linear(x, wkv.to(x.dtype))  # [T, Dk]
    score = torch.nn.functional.linear(x, wgate.to(x.dtype))  # [T, Dk]
    cu = check_pool_inputs(kv, score, ape, ratio, overlap, cu_seqlens, cu_seqlens_host)
    pooled, cu_c = compressor_pool_triton(
        kv, score, ape, ratio, overlap, cu_seqlens, cu_seqlens_host=cu
    )  # [Tc, c] fp32
    positions = compressed_positions_host(cu, ratio, cu_c)  # [Tc]
    max_pos = max_entry_position(compressed_cu_seqlens_host(cu, ratio), ratio)
    rotated = _norm_rope_cached(pooled, norm_weight, eps, positions, rope_cfg, max_pos)
    return rotated.to(x.dtype), cu_c
