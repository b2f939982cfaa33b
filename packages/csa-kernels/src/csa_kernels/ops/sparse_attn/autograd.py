"""Autograd binding of the fused sparse attention kernels (``sparse_attn_triton``)."""

from __future__ import annotations

import torch

from csa_kernels._triton_utils import resolve_deterministic
from csa_kernels.ops.sparse_attn.checks import check_inputs
from csa_kernels.ops.sparse_attn.triton import compact_indices, sparse_attn_bwd, sparse_attn_fwd


class SparseAttnTritonFunction(torch.autograd.Function):
    """o, lse = sparse_attn(q, kv, sink, indices); saves q, kv, sink, compacted indices, o and lse."""

    @staticmethod
    def forward(ctx, q, kv, attn_sink, indices, softmax_scale, deterministic):
        idx_c, counts = compact_indices(indices)
        o, lse = sparse_attn_fwd(q, kv, attn_sink, idx_c, counts, softmax_scale)
        ctx.save_for_backward(q, kv, attn_sink, idx_c, counts, o, lse)
        ctx.softmax_scale = softmax_scale
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, kv, attn_sink, idx_c, counts, o, lse = ctx.saved_tensors
        # lse is marked non-differentiable (callers use it detached, e.g. the indexer loss teacher).
        if do is None:
            do = torch.zeros_like(o)
        dq, dkv, dsink = sparse_attn_bwd(
            q, kv, attn_sink, idx_c, counts, ctx.softmax_scale, o, lse, do, deterministic=ctx.deterministic
        )
        return dq, dkv, dsink.to(attn_sink.dtype), None, None, None


def _check(q, kv, attn_sink, indices, softmax_scale, check_indices: bool) -> None:
    check_inputs(q, kv, attn_sink, indices, softmax_scale, check_indices)
    if q.dtype != kv.dtype:
        raise ValueError(
            f"q and kv must share one floating dtype (bf16 on GPU), got {q.dtype} and {kv.dtype}"
        )


def sparse_attn_triton(
    q: torch.Tensor,  # [T, H, D]
    kv: torch.Tensor,  # [Nkv, D]
    attn_sink: torch.Tensor,  # [H] fp32
    indices: torch.Tensor,  # [T, K] int32, -1 = empty
    softmax_scale: float,
    *,
    check_indices: bool = True,
    deterministic: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused Triton sparse MQA attention with sink; ``(o [T, H, D] q.dtype, lse [T, H] fp32)``, differentiable.

    Same contract and validation as :func:`csa_kernels.ops.sparse_attn.reference.sparse_attn_ref`;
    ``check_indices=False`` skips the index-range and finite-sink checks (their device -> host sync).
    ``deterministic``: the backward's ``dkv`` without atomics (inverted-index gather-reduce, bitwise
    reproducible); ``None``: :func:`csa_kernels.deterministic_default` (``True`` unless set otherwise) or
    ``torch.are_deterministic_algorithms_enabled()``.
    """
    _check(q, kv, attn_sink, indices, softmax_scale, check_indices)
    det = resolve_deterministic(deterministic)
    return SparseAttnTritonFunction.apply(q, kv, attn_sink, indices, softmax_scale, det)
