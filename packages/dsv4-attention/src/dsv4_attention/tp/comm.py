"""Autograd collectives of tensor parallelism with sequence parallelism (one TP group, passed explicitly).

* ``gather_rows(x [L, *], group) -> [P*L, *]``: the sequence-parallel all-gather (megatron's
  ``gather_from_sequence_parallel_region``); backward: the gradient summed over ranks, this rank's rows
  (reduce-scatter; all-reduce + slice on gloo). It is :func:`dsv4_attention.cp.comm.all_gather_rows`.
* ``reduce_scatter_rows(y [P*L, *], group) -> [L, *]``: the sum over ranks of each rank's partial ``y``, this
  rank's rows (megatron's ``reduce_scatter_to_sequence_parallel_region``: the row-parallel output projection);
  backward: the all-gather of the gradient.
* ``gather_ids(x [L, *], group) -> [P*L, *]``: all-gather without autograd (top-k entry ids).
* ``logsumexp_to_rows(z [P*L, *], group) -> [L, *]``: ``log Σ_r exp(z_r)`` of this rank's rows (one all-to-all, no
  autograd): the head-partial teacher log-mass of the indexer loss summed over the TP ranks' heads exactly, with no
  underflow of ``exp`` in any dtype.

megatron-core 0.19.2's own mappings allocate on ``torch.cuda.current_device()`` and call ``reduce_scatter_tensor``,
which gloo does not have; these helpers call the same collectives on NCCL and their all-reduce / all-to-all
equivalents on gloo, so the CPU tests run the same code as the GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsv4_attention.cp.comm import _has_reduce_scatter, _reduce_scatter_rows, all_gather_rows

gather_rows = all_gather_rows


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    p = dist.get_world_size(group)
    src = x.contiguous()
    out = src.new_empty(p * src.shape[0], *src.shape[1:])
    dist.all_gather_into_tensor(out, src, group=group)
    return out


def _reduce_scatter(y: torch.Tensor, group) -> torch.Tensor:
    """``y [P*m, *]`` summed over ranks -> this rank's ``[m, *]`` rows (the CP gradient helper; on gloo it
    all-reduces in place, so ``y`` is copied first and the slice is its own tensor)."""
    if _has_reduce_scatter(group):
        return _reduce_scatter_rows(y, group)
    return _reduce_scatter_rows(y.clone(), group).clone()


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(y, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.group), None


def reduce_scatter_rows(y: torch.Tensor, group) -> torch.Tensor:
    """``y [P*L, *]`` (this rank's partial) -> ``[L, *]`` summed over ranks (module docstring)."""
    if y.shape[0] % dist.get_world_size(group):
        raise ValueError(f"reduce_scatter_rows: {y.shape[0]} rows are not a multiple of the group size")
    return _ReduceScatterRows.apply(y, group)


def gather_ids(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather ``x [L, *]`` -> ``[P*L, *]`` rank-major, no autograd."""
    return _all_gather(x.detach(), group)


def logsumexp_to_rows(z: torch.Tensor, group) -> torch.Tensor:
    """``z [P*L, *]`` (this rank's partial log-sums) -> ``log Σ_r exp(z_r[rows of this rank]) [L, *]``.

    One all-to-all: rank ``r`` receives every rank's rows ``[r*L, (r+1)*L)``, then a local ``logsumexp`` over the
    ranks (``-inf`` where every rank has ``-inf``). No autograd (the teacher is detached)."""
    p = dist.get_world_size(group)
    src = z.detach().contiguous()
    out = torch.empty_like(src)  # [P, L, *] after the exchange: block q = rank q's partial of our rows
    dist.all_to_all_single(out, src, group=group)
    return torch.logsumexp(out.view(p, src.shape[0] // p, *src.shape[1:]), dim=0)
