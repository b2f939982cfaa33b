"""Static-bounds (CUDA-graph) form of the compressor pooling: document bounds on the device, entry capacity on the
host (:mod:`csa_kernels.static_bounds`).

``pooled [T // ratio, c]``: rows ``0 .. cu_seqlens_c[-1] - 1`` equal :func:`~csa_kernels.compressor_pool`'s output
(the same kernel; one grid of ``T // ratio`` entries whose programs past the real count, read on the device, do
nothing), the padding rows are zero and get no gradient.
"""

from __future__ import annotations

import torch

from csa_kernels.ops.compressor.checks import check_pool_shapes
from csa_kernels.static_bounds import StaticBounds
from dsv4_primitives.dispatch import resolve_backend


class CompressorPoolStaticFunction(torch.autograd.Function):
    """pooled = pool(kv, score, ape) over ``tc`` capacity entries (real count on the device)."""

    @staticmethod
    def forward(ctx, kv, score, ape, cu, cuc, tc, ratio, overlap):
        from csa_kernels.ops.compressor.triton import compressor_pool_fwd

        ape32 = ape.float().contiguous()
        pooled = compressor_pool_fwd(kv, score, ape32, cu, cuc, tc, ratio, overlap, tc_on_device=True)
        ctx.save_for_backward(kv, score, ape32, cu, cuc)
        ctx.tc, ctx.ratio, ctx.overlap, ctx.ape_dtype = tc, ratio, overlap, ape.dtype
        return pooled

    @staticmethod
    def backward(ctx, dpooled):
        from csa_kernels.ops.compressor.triton import compressor_pool_bwd

        kv, score, ape32, cu, cuc = ctx.saved_tensors
        dkv, dscore, dape = compressor_pool_bwd(
            kv, score, ape32, cu, cuc, ctx.tc, ctx.ratio, ctx.overlap, dpooled, tc_on_device=True
        )
        return dkv, dscore, dape.to(ctx.ape_dtype), None, None, None, None, None


def compressor_pool_static(
    kv: torch.Tensor,  # [T, Dk]
    score: torch.Tensor,  # [T, Dk]
    ape: torch.Tensor,  # [ratio, Dk]
    ratio: int,
    overlap: bool,
    bounds: StaticBounds,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pooled [T // ratio, c] fp32, cu_seqlens_c int32 [N_cap + 1])`` of a static-shape pack.

    Math: :func:`~csa_kernels.ops.compressor.reference.compressor_pool_ref` per document. Triton backend: no
    device -> host read, capturable. Reference backend (CPU; never captured): reads the bounds back and runs the
    reference, then pads to the capacity.
    """
    if kv.shape[0] != bounds.total:
        raise ValueError(f"kv has {kv.shape[0]} rows but the static bounds cover {bounds.total}")
    cap = bounds.entry_capacity(ratio)
    cuc = bounds.compressed(ratio)  # [N_cap + 1] int32, on the device
    if resolve_backend(backend, kv, score, op="csa_kernels.compressor_pool") == "triton":
        check_pool_shapes(kv, score, ape, ratio, overlap)
        cu = bounds.cu_seqlens.to(torch.int32)
        kv = kv if kv.stride(-1) == 1 else kv.contiguous()
        score = score if score.stride(-1) == 1 else score.contiguous()
        return CompressorPoolStaticFunction.apply(kv, score, ape, cu, cuc, cap, ratio, overlap), cuc
    from csa_kernels.ops.compressor.reference import compressor_pool_ref

    host = [int(v) for v in bounds.cu_seqlens.tolist()]
    pooled, _ = compressor_pool_ref(kv, score, ape, ratio, overlap, bounds.cu_seqlens, cu_seqlens_host=host)
    return torch.nn.functional.pad(pooled, (0, 0, 0, cap - pooled.shape[0])), cuc


__all__ = ["CompressorPoolStaticFunction", "compressor_pool_static"]
