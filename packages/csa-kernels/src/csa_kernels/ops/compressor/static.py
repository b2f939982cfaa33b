"""Static-bounds (CUDA-graph) form of the compressor pooling: document bounds on the device, entry capacity on the
host (:mod:`csa_kernels.static_bounds`).

``pooled [T // ratio, c]``: rows ``0 .. cu_seqlens_c[-1] - 1`` equal :func:`~csa_kernels.compressor_pool`'s output
(the same kernel; one grid of ``T // ratio`` entries whose programs past the real count, read on the device, do
nothing), the padding rows are zero and get no gradient.
"""

from __future__ import annotations

import torch

from csa_kernels.ops.compressor.autograd import CompressorPoolTritonFunction
from csa_kernels.ops.compressor.checks import check_pool_shapes
from csa_kernels.ops.compressor.reference import compressor_pool_ref
from csa_kernels.static_bounds import StaticBounds
from dsv4_primitives.dispatch import resolve_backend


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
        return CompressorPoolTritonFunction.apply(kv, score, ape, cu, cuc, cap, ratio, overlap, True), cuc

    host = [int(v) for v in bounds.cu_seqlens.tolist()]
    pooled, _ = compressor_pool_ref(kv, score, ape, ratio, overlap, bounds.cu_seqlens, cu_seqlens_host=host)
    return torch.nn.functional.pad(pooled, (0, 0, 0, cap - pooled.shape[0])), cuc


__all__ = ["compressor_pool_static"]
