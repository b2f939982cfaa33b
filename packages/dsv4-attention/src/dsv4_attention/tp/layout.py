"""``TensorParallelLayout``: one TP rank's view of a global packed layout under sequence parallelism.

Under megatron's sequence parallelism the hidden rows of TP rank ``r`` of ``P`` are the contiguous rows
``[r*L, (r+1)*L)`` of the global pack of ``T = P*L`` rows: exactly a context-parallel slice. So the layout holds
the GLOBAL :class:`~dsv4_attention.layout.TokenLayout` (identical on every TP rank) and its sequence split over the
TP group as a :class:`~dsv4_attention.cp.layout.ContextParallelLayout` (:attr:`sequence`), whose per-kind plans
(halo, compressed-entry ownership, index maps) the token-local half of the layer reuses unchanged.

With context parallelism as well (TP x CP, :func:`tensor_context_parallel_layout`): CP rank ``c`` of ``C`` holds
the contiguous chunk ``c`` of ``T / C`` rows and sequence parallelism splits it over TP, so rank ``(c, t)`` holds
rows ``[(c*P + t)*L, (c*P + t + 1)*L)``, ``L = T / (C*P)``: one contiguous slice of the pack in ``(c, t)`` order,
TP fastest (megatron's tensor-and-context-parallel group). The sequence split is then over that TP x CP group, and
the head half (this rank's ``n_h / P`` heads of its CP chunk's rows) runs on the CP split of the global layout
(:attr:`context`, over the CP group).
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
        global_layout: the layout of all ``T`` rows.
        sequence: the sequence split of ``global_layout`` over the TP group (TP x CP: the TP x CP group, rank
            ``c*P + t``); this rank holds its rows ``[local_start, local_stop)``.
        context: the CP split of ``global_layout`` over the CP group (TP x CP; the head half's rows), else ``None``.
        tp_group: the TP group when ``context`` is set (TP only: ``sequence.group``).
    """

    global_layout: TokenLayout
    sequence: ContextParallelLayout
    context: ContextParallelLayout | None = None
    tp_group: object = None

    @property
    def group(self):
        """The TP process group (the heads are split over it)."""
        return self.sequence.group if self.context is None else self.tp_group

    @property
    def size(self) -> int:
        """The TP size ``P``."""
        return self.sequence.size if self.context is None else self.sequence.size // self.context.size

    @property
    def rank(self) -> int:
        """This rank's TP rank ``t`` (the sequence rank is ``c*P + t``)."""
        return self.sequence.rank % self.size

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    @property
    def local_rows(self) -> slice:
        """This rank's rows of the global pack."""
        return slice(self.sequence.local_start, self.sequence.local_stop)

    @property
    def head_rows(self) -> slice:
        """This rank's rows among the head half's query rows (all ``T`` rows under TP only, the CP chunk's rows
        under TP x CP): ``[t*L, (t+1)*L)``."""
        start = 0 if self.context is None else self.context.local_start
        return slice(self.sequence.local_start - start, self.sequence.local_stop - start)


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


def tensor_context_parallel_layout(
    global_layout: TokenLayout, tp_group, cp_group, tp_cp_group
) -> TensorParallelLayout:
    """This rank's :class:`TensorParallelLayout` under TP x CP (module docstring): ``tp_group`` of ``P`` ranks,
    ``cp_group`` of ``C`` ranks and their product ``tp_cp_group`` (megatron's tensor-and-context-parallel group),
    in which this rank must be ``c*P + t``. ``T`` must be a multiple of ``C*P``. ``cp_group`` ``None`` or of size
    1: :func:`tensor_parallel_layout`."""
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return tensor_parallel_layout(global_layout, tp_group)
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    t = 0 if tp_group is None else dist.get_rank(tp_group)
    cp, c = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    if tp_cp_group is None or dist.get_world_size(tp_cp_group) != tp * cp:
        got = None if tp_cp_group is None else dist.get_world_size(tp_cp_group)
        raise ValueError(
            f"TP x CP needs the tensor-and-context-parallel group of TP {tp} x CP {cp} = {tp * cp} ranks, got "
            f"{got}: pass pg_collection.tp_cp (megatron's tensor-and-context-parallel group)"
        )
    if dist.get_rank(tp_cp_group) != c * tp + t:
        raise ValueError(
            f"rank {dist.get_rank()} is rank {dist.get_rank(tp_cp_group)} of the TP x CP group but CP rank {c} / TP "
            f"rank {t}: the sequence order needs TP fastest (rank c*TP + t = {c * tp + t}); build the groups with "
            "megatron's order 'tp-cp-...'"
        )
    if global_layout.num_tokens % (tp * cp):
        raise ValueError(
            f"the packed buffer has {global_layout.num_tokens} rows, not a multiple of TP x CP = {tp * cp}: every "
            f"rank holds T / (TP*CP) rows; pad the pack to a multiple of {tp * cp}"
        )
    seq = ContextParallelLayout(global_layout, tp_cp_group, c * tp + t, tp * cp)
    context = ContextParallelLayout(global_layout, cp_group, c, cp)
    return TensorParallelLayout(global_layout, seq, context, tp_group)
