"""Packed MTP roll (P9): ``roll_left`` on a packed THD buffer that never crosses a document boundary.

Multi-token prediction shifts tokens, labels and masks one step to the left per MTP depth. On a packed buffer a
plain ``torch.roll`` would pull the first token of the next document into the last row of the previous one. Here

    out[g] = x[g + k]   if g and g + k lie in the same *padded* document [cu_p[d], cu_p[d+1])
    out[g] = fill       otherwise (the last k rows of every padded document, tail rows past cu_p[-1])

with ``k = shifts`` and ``cu_p = cu_seqlens_padded``: the padded boundaries define the layout (and the CP-local
layout), so a real token may receive a per-document padding row, which the rolled loss mask (fill 0) hides.
Gradients flow through the gathered rows (filled rows get none).

Shape legend: ``T`` rows, ``...`` any trailing feature dims.
"""

from __future__ import annotations

import torch

from thd_packing.packed_seqs import PackedSeqs


def padded_boundaries(boundaries: PackedSeqs | torch.Tensor) -> torch.Tensor:
    """The ``[N+1]`` int64 padded cu array of a ``PackedSeqs`` or of an explicit cu tensor."""
    if isinstance(boundaries, PackedSeqs):
        return boundaries.cu_seqlens_padded.to(torch.int64)
    cu = torch.as_tensor(boundaries)
    if cu.dim() != 1 or cu.numel() < 1 or cu.dtype.is_floating_point:
        raise ValueError(
            f"cu_seqlens_padded must be a 1-D integer [N+1] tensor, got {cu.dtype} {tuple(cu.shape)}"
        )
    cu = cu.to(torch.int64)
    if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens_padded must start at 0 and be non-decreasing, got {cu.tolist()}")
    return cu


def roll_valid_rows(rows: torch.Tensor, cu_padded: torch.Tensor, shifts: int) -> torch.Tensor:
    """``[R]`` bool: global row ``g`` may read row ``g + shifts`` (both inside one padded document).

    ``rows`` are int64 global row indices; ``cu_padded`` is int64 ``[N+1]``; empty documents (repeated boundaries)
    need no special care because ``searchsorted(..., right=True)`` skips them.
    """
    ends = cu_padded[1:].to(rows.device)
    if ends.numel() == 0:
        return torch.zeros_like(rows, dtype=torch.bool)
    doc = torch.searchsorted(ends, rows, right=True)
    inside = rows < ends[-1]
    end = ends[doc.clamp(max=ends.numel() - 1)]
    return inside & (rows + shifts < end)


def _check_shifts(shifts: int) -> None:
    if not isinstance(shifts, int) or shifts < 1:
        raise ValueError(f"shifts must be a positive int (rows to move left), got {shifts!r}")


def roll_left(
    x: torch.Tensor,
    boundaries: PackedSeqs | torch.Tensor,
    *,
    shifts: int = 1,
    fill_value: float | int | bool = 0,
    dim: int = 0,
    validate: bool = True,
) -> torch.Tensor:
    """Roll a packed tensor ``shifts`` rows to the left inside each padded document (module docstring).

    Args:
        x: ``[..., T, ...]`` with the packed row dimension at ``dim`` (``T >= cu_seqlens_padded[-1]``).
        boundaries: the pack's ``PackedSeqs`` (its ``cu_seqlens_padded`` is used) or a padded cu tensor.
        shifts: rows to move left (MTP depth step), >= 1.
        fill_value: value of rows with no source in their document (0 for tokens/labels/loss masks, True for
            padding masks).
        dim: the packed row dimension.
        validate: check the boundaries' values (reads them back to the host). ``False``: the caller guarantees
            them (static-shape packs under CUDA graphs, whose boundaries must stay on the device).

    Returns:
        A new tensor shaped like ``x``.
    """
    _check_shifts(shifts)
    if validate:
        cu = padded_boundaries(boundaries)
    else:
        cu = boundaries.cu_seqlens_padded if isinstance(boundaries, PackedSeqs) else boundaries
        cu = cu.to(torch.int64)
    xm = x.movedim(dim, 0)  # [T, ...]
    t = xm.size(0)
    if validate and t < int(cu[-1]):
        raise ValueError(f"x has {t} rows along dim {dim} but cu_seqlens_padded[-1] is {int(cu[-1])}")
    rows = torch.arange(t, dtype=torch.int64, device=x.device)
    valid = roll_valid_rows(rows, cu, shifts)
    src = (rows + shifts).clamp(max=max(t - 1, 0))
    shifted = xm[src]
    valid = valid.reshape((t,) + (1,) * (xm.dim() - 1))
    out = torch.where(valid, shifted, torch.full_like(shifted, fill_value))
    return out.movedim(0, dim)
