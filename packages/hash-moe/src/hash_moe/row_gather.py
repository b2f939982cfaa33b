"""Atomic-free row movement: gathers whose backward is another gather through the inverse index map.

Two primitives (plain functions, a PyTorch path and the Triton kernels of :mod:`hash_moe.kernels.permute_triton`):

```
gather_rows(src, idx)       out[i] = src[idx[i]]                       idx: [R], -1 = zero row
gather_sum_rows(src, idx)   out[t] = Σ_k src[idx[t, k]]  (k ascending)  idx: [T, K], -1 = no term; fp32 sum
```

and two differentiable wrappers, each taking the *adjoint* index map of its forward map:

```
y = row_gather(x, idx [R], adjoint [N, K])        dx[j] = Σ_k dy[adjoint[j, k]]
y = row_gather_sum(x, idx [T, K], adjoint [R])    dx[i] = dy[adjoint[i]]
```

``adjoint`` lists, for every source row, the output rows that read it (``row_gather``) or the one output row that
sums it (``row_gather_sum``). PyTorch's own ``index_select`` backward is an ``index_add_`` with atomics on CUDA
(non-deterministic in bf16, slow on large rows); here each gradient row is written once by one program, so both
directions are deterministic. Sums run in fp32 (fp64 for fp64 inputs) and round once to the input dtype.

Shape legend: ``N`` source rows, ``R`` gathered rows, ``T`` summed rows, ``K`` terms per summed row, ``C`` columns.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch.autograd.function import once_differentiable

from dsv4_primitives.dispatch import resolve_backend
from hash_moe.kernels.permute_triton import gather_rows_triton, gather_sum_rows_triton

RowBackend = Literal["auto", "triton", "reference"]


def resolve_row_backend(backend: RowBackend, src: torch.Tensor, op: str = "hash_moe.gather_rows") -> str:
    """``"triton"`` or ``"reference"`` (:func:`dsv4_primitives.dispatch.resolve_backend`): ``"auto"`` is Triton on
    CUDA tensors, PyTorch elsewhere (``HASH_MOE_BACKEND`` / ``DSV4_BACKEND`` override it)."""
    return resolve_backend(backend, src, op=op)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def gather_rows_torch(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """PyTorch path of :func:`gather_rows`: ``index_select`` of the clamped index, then zero the ``-1`` rows."""
    if src.shape[0] == 0:
        return src.new_zeros(idx.shape[0], src.shape[1])
    out = src.index_select(0, idx.clamp(min=0))  # [R, C]
    return out.masked_fill_((idx < 0).unsqueeze(1), 0)


def gather_sum_rows_torch(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """PyTorch path of :func:`gather_sum_rows`: ``K`` gathers added in the order of ``k`` into an fp32 buffer."""
    acc = torch.zeros(idx.shape[0], src.shape[1], device=src.device, dtype=_acc_dtype(src.dtype))  # [T, C]
    for k in range(idx.shape[1]):
        acc += gather_rows_torch(src, idx[:, k]).to(acc.dtype)
    return acc.to(src.dtype)


def gather_rows(src: torch.Tensor, idx: torch.Tensor, *, backend: RowBackend = "auto") -> torch.Tensor:
    """``out [R, C]``: ``out[i] = src[idx[i]]``, a zero row where ``idx[i] < 0`` (not differentiable).

    Args:
        src: ``[N, C]`` rows.
        idx: ``[R]`` integer row indices into ``src``, or -1.
        backend: ``"triton"`` (kernel), ``"reference"`` (PyTorch) or ``"auto"`` (Triton on CUDA).
    """
    src = _as_rows(src)
    if resolve_row_backend(backend, src) == "reference":
        return gather_rows_torch(src, idx)

    return gather_rows_triton(src, idx.contiguous())


def gather_sum_rows(src: torch.Tensor, idx: torch.Tensor, *, backend: RowBackend = "auto") -> torch.Tensor:
    """``out [T, C]``: ``out[t] = Σ_k src[idx[t, k]]`` over ``idx[t, k] >= 0``, fp32 sum in the order of ``k``.

    ``K = 1`` is an exact copy (a gather). The output takes ``src.dtype`` (not differentiable).
    """
    src = _as_rows(src)
    if idx.shape[1] == 1:
        return gather_rows(src, idx[:, 0], backend=backend)
    if resolve_row_backend(backend, src) == "reference":
        return gather_sum_rows_torch(src, idx)

    return gather_sum_rows_triton(src, idx.contiguous())


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[N, C]`` with a unit column stride (a copy only when it has none)."""
    return t if t.stride(-1) == 1 else t.contiguous()


class _AdjointGather(torch.autograd.Function):
    """``gather_rows`` / ``gather_sum_rows`` (``summed``); the backward is the other one through ``adjoint``."""

    @staticmethod
    def forward(ctx, src, idx, adjoint, backend, summed):
        ctx.save_for_backward(adjoint)
        ctx.backend, ctx.summed = backend, summed
        return (gather_sum_rows if summed else gather_rows)(src, idx, backend=backend)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (adjoint,) = ctx.saved_tensors
        adjoint_op = gather_rows if ctx.summed else gather_sum_rows
        return adjoint_op(grad, adjoint, backend=ctx.backend), None, None, None, None


def row_gather(
    src: torch.Tensor, idx: torch.Tensor, adjoint: torch.Tensor, *, backend: RowBackend = "auto"
) -> torch.Tensor:
    """Differentiable :func:`gather_rows` whose backward is ``d src = gather_sum_rows(d out, adjoint)``.

    Args:
        src: ``[N, C]``.
        idx: ``[R]`` source row of each output row, or -1 (zero row).
        adjoint: ``[N, K]`` the output rows reading each source row (``idx[adjoint[j, k]] == j``), -1 padded; every
            ``i`` with ``idx[i] = j >= 0`` must be listed in ``adjoint[j]`` (not checked: internal maps only).
        backend: see :func:`gather_rows`.
    """
    assert adjoint.dim() == 2 and adjoint.shape[0] == src.shape[0], "adjoint must be [N, K]"
    return _AdjointGather.apply(src, idx, adjoint, backend, False)


def row_gather_sum(
    src: torch.Tensor, idx: torch.Tensor, adjoint: torch.Tensor, *, backend: RowBackend = "auto"
) -> torch.Tensor:
    """Differentiable :func:`gather_sum_rows` whose backward is ``d src = gather_rows(d out, adjoint)``.

    Args:
        src: ``[R, C]``.
        idx: ``[T, K]`` source rows summed into each output row, -1 padded; each source row appears at most once.
        adjoint: ``[R]`` the output row summing each source row (``adjoint[idx[t, k]] == t``), or -1.
        backend: see :func:`gather_rows`.
    """
    assert adjoint.dim() == 1 and adjoint.shape[0] == src.shape[0], "adjoint must be [R]"
    return _AdjointGather.apply(src, idx, adjoint, backend, True)
