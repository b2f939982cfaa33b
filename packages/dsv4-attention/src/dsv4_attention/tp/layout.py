"""``TensorParallelLayout``: one TP rank's view of a global packed layout under sequence parallelism.

Under megatron's sequence parallelism the hidden rows of TP rank ``r`` of ``P`` are the contiguous rows
``[r*L, (r+1)*L)`` of the global pack of ``T = P*L`` rows: exactly a context-parallel slice. So the layout holds
the GLOBAL :class:`~dsv4_attention.layout.TokenLayout` (identical on every TP rank) and its sequence split over the
TP group as a :class:`~dsv4_attention.cp.layout.ContextParallelLayout` (:attr:`sequence`), whose per-kind plans
(halo, compressed-entry ownership, index maps) the token-local half of the layer reuses unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from dsv4_attention.cp.layout import ContextParallelLayout
from dsv4_attention.layout import TokenLayout


@dataclass(frozen=True)
class TensorParallelLayout:
    """This TP rank's view of ``global_layout`` (see the module docstring).

    Attributes:
        global_layout: the layout of all ``T = size * L`` rows.
        sequence: the sequence split of ``global_layout`` over the TP group (rank ``r`` holds rows ``[r*L, (r+1)*L)``).
    """

    global_layout: TokenLayout
    sequence: ContextParallelLayout

    @property
    def group(self):
        return self.sequence.group

    @property
    def size(self) -> int:
        return self.sequence.size

    @property
    def rank(self) -> int:
        return self.sequence.rank

    @property
    def is_parallel(self) -> bool:
        return self.sequence.size > 1

    @property
    def local_rows(self) -> slice:
        """This rank's rows of the global pack."""
        return slice(self.sequence.local_start, self.sequence.local_stop)


def tensor_parallel_layout(global_layout: TokenLayout, tp_group) -> TensorParallelLayout:
    """This rank's :class:`TensorParallelLayout` of ``global_layout`` over ``tp_group`` (``None`` or size 1: one
    rank; ``T`` must be a multiple of the TP size: sequence parallelism gives every rank ``T / TP`` rows)."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return TensorParallelLayout(global_layout, ContextParallelLayout(global_layout, None, 0, 1))
    size = dist.get_world_size(tp_group)
    if global_layout.num_tokens % size:
        raise ValueError(
            f"the packed buffer has {global_layout.num_tokens} rows, not a multiple of the tensor-parallel size "
            f"{size}: sequence parallelism gives every TP rank T / TP rows; pad the pack to a multiple of {size}"
        )
    seq = ContextParallelLayout(global_layout, tp_group, dist.get_rank(tp_group), size)
    return TensorParallelLayout(global_layout, seq)
