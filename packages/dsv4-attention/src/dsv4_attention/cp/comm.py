"""Autograd collectives of static contiguous context parallelism (one CP group, passed explicitly).

``all_gather_rows(x [m, *], group) -> [P*m, *]`` (rank-major): forward all-gathers the rows; backward sums the
gradient over ranks and keeps this rank's slice (reduce-scatter where the backend has it, else all-reduce + slice:
gloo has no reduce-scatter). The gradient is summed in the gradient's dtype (fp32 for fp32 models; bf16 models sum
bf16 like megatron's data-parallel reduce-scatter).

``start_all_gather_rows`` launches the forward collective asynchronously and returns a :class:`PendingGather` whose
``wait()`` yields the same autograd-connected result, so local compute can overlap the transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def _has_reduce_scatter(group) -> bool:
    return dist.get_backend(group) != "gloo"


def _reduce_scatter_rows(grad: torch.Tensor, group) -> torch.Tensor:
    """``grad [P*m, *]`` summed over ranks -> this rank's ``[m, *]`` slice."""
    p = dist.get_world_size(group)
    m = grad.shape[0] // p
    grad = grad.contiguous()
    if _has_reduce_scatter(group):
        out = grad.new_empty(m, *grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad, group=group)
        return out
    dist.all_reduce(grad, group=group)
    r = dist.get_rank(group)
    return grad[r * m : (r + 1) * m]


class _GatheredRows(torch.autograd.Function):
    """Identity on an already gathered buffer; its backward reduce-scatters the gradient to ``x``'s rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gathered: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return gathered

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter_rows(grad, ctx.group), None, None


@dataclass
class PendingGather:
    """An in-flight all-gather of ``x``'s rows; :meth:`wait` returns the rank-major ``[P*m, *]`` result."""

    x: torch.Tensor
    out: torch.Tensor
    work: object
    group: object

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if not self.x.requires_grad:
            return self.out
        return _GatheredRows.apply(self.x, self.out, self.group)


def start_all_gather_rows(x: torch.Tensor, group) -> PendingGather:
    """Launch the all-gather of ``x [m, *]`` over ``group`` (async); ``.wait()`` -> ``[P*m, *]`` (autograd)."""
    p = dist.get_world_size(group)
    src = x.detach().contiguous()
    out = src.new_empty(p * src.shape[0], *src.shape[1:])
    work = dist.all_gather_into_tensor(out, src, group=group, async_op=True)
    return PendingGather(x, out, work, group)


def all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather ``x [m, *]`` over ``group`` -> ``[P*m, *]`` rank-major; gradient reduce-scattered back."""
    return start_all_gather_rows(x, group).wait()
