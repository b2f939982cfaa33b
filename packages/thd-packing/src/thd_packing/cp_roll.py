"""Packed MTP roll under static contiguous context parallelism (P9, ``cp_partition_mode='contiguous'``).

Rank ``r`` holds the rows ``[r*L, (r+1)*L)`` of the global padded buffer. The roll of :func:`thd_packing.roll_left`
needs, for its last ``k`` local rows, the first ``k`` rows of rank ``r+1``; so every rank sends its first ``k`` rows
to rank ``r-1`` and receives rank ``r+1``'s: one point-to-point exchange on the CP group, passed explicitly.
Validity of each row comes from *global* row indices ``r*L + i`` bucketized against the global
``cu_seqlens_padded``, so documents crossing rank boundaries and empty documents are handled exactly like on one rank.
The backward sends the gradient of the received rows back to their owner (one P2P the other way).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from thd_packing.packed_seqs import PackedSeqs
from thd_packing.roll import _check_shifts, padded_boundaries, roll_valid_rows


def _exchange(send: torch.Tensor, recv_shape, group, *, toward_lower: bool) -> torch.Tensor:
    """Send ``send`` to the neighbour on one side and receive a same-shaped block from the other side.

    ``toward_lower``: send to ``rank-1``, receive from ``rank+1`` (zeros on the last rank). Otherwise the reverse.
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    recv = torch.zeros(recv_shape, dtype=send.dtype, device=send.device)
    dst = rank - 1 if toward_lower else rank + 1
    src = rank + 1 if toward_lower else rank - 1
    ops = []
    if 0 <= dst < size:
        ops.append(dist.P2POp(dist.isend, send.contiguous(), dist.get_global_rank(group, dst), group))
    if 0 <= src < size:
        ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, src), group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return recv


class _ContiguousCpRollLeft(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, valid, shifts, fill_value, group):
        # x: [L, ...] local rows; valid: [L] bool
        local = x.size(0)
        halo = _exchange(x[:shifts], (shifts,) + tuple(x.shape[1:]), group, toward_lower=True)  # [k, ...]
        ext = torch.cat([x, halo])  # [L + k, ...]
        shifted = ext[shifts : shifts + local]
        mask = valid.reshape((local,) + (1,) * (x.dim() - 1))
        ctx.save_for_backward(mask)
        ctx.shifts, ctx.group = shifts, group
        return torch.where(mask, shifted, torch.full_like(shifted, fill_value))

    @staticmethod
    def backward(ctx, grad_out):
        (mask,) = ctx.saved_tensors
        k, local = ctx.shifts, grad_out.size(0)
        g = torch.where(mask, grad_out, torch.zeros_like(grad_out))
        grad_ext = torch.cat([torch.zeros_like(g[:k]), g])  # [L + k, ...]: out[i] read ext[i + k]
        grad_x = grad_ext[:local].clone()
        from_higher = _exchange(grad_ext[local:], grad_x[:k].shape, ctx.group, toward_lower=False)
        grad_x[:k] += from_higher
        return grad_x, None, None, None, None


def roll_left_contiguous_cp(
    x_local: torch.Tensor,
    boundaries: PackedSeqs | torch.Tensor,
    cp_group: dist.ProcessGroup,
    *,
    shifts: int = 1,
    fill_value: float | int | bool = 0,
    dim: int = 0,
) -> torch.Tensor:
    """``roll_left`` of the global buffer, computed on this rank's contiguous slice.

    Args:
        x_local: ``[..., L, ...]`` this CP rank's rows (``L`` along ``dim``, the same on every rank).
        boundaries: the *global* pack (``PackedSeqs`` or its ``cu_seqlens_padded``), ``cu_seqlens_padded[-1] <=
            L * cp``.
        cp_group: the context-parallel process group (e.g. ``pg_collection.cp``); ranks are ordered by it.
        shifts: rows to move left, ``1 <= shifts <= L`` (the halo comes from the next rank only).
        fill_value: value of rows whose source lies in another document or in the tail.
        dim: the packed row dimension.

    Returns:
        ``[..., L, ...]``: equal to ``shard(roll_left(global_x))``. Differentiable for floating ``x_local``.
    """
    _check_shifts(shifts)
    cu = padded_boundaries(boundaries)
    rank, size = dist.get_rank(cp_group), dist.get_world_size(cp_group)
    xm = x_local.movedim(dim, 0)  # [L, ...]
    local = xm.size(0)
    if shifts > local:
        raise ValueError(
            f"shifts={shifts} exceeds the {local} local rows; one neighbour exchange cannot serve it"
        )
    if int(cu[-1]) > local * size:
        raise ValueError(
            f"cu_seqlens_padded[-1]={int(cu[-1])} exceeds the global buffer ({local} rows x cp {size}); pass the "
            "global boundaries and this rank's slice"
        )
    rows = rank * local + torch.arange(local, dtype=torch.int64, device=x_local.device)
    valid = roll_valid_rows(rows, cu, shifts)
    out = _ContiguousCpRollLeft.apply(xm, valid, shifts, fill_value, cp_group)
    return out.movedim(0, dim)
