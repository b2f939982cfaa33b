"""Static contiguous context parallelism for DSv4 attention (upstream D7 + D8), exact against CP=1.

CP rank ``r`` of ``P`` owns global rows ``[r*L, (r+1)*L)`` of the padded packed buffer (``T = P*L``). Build this
rank's :class:`ContextParallelLayout` from the GLOBAL layout with :func:`context_parallel_layout` and pass it to
``DSv4Attention.forward(x_local [L, d], cp_layout)``; outputs and gradients equal the CP=1 run's rows of this rank,
the returned indexer loss is this rank's partial (:mod:`dsv4_primitives.cp_partial_loss`).

The layer runs its one forward (:mod:`dsv4_attention.attention_plan`) with this rank's
:class:`~dsv4_attention.cp.rank_plan.ContextParallelPlan` instead of the trivial single-rank plan.

Modules: :mod:`~dsv4_attention.cp.comm` (autograd all-gather / reduce-scatter), :mod:`~dsv4_attention.cp.layout`
(the layout), :mod:`~dsv4_attention.cp.plan` (per-kind index maps: halo, window, ownership, id -> gathered row),
:mod:`~dsv4_attention.cp.halo`, :mod:`~dsv4_attention.cp.compressed` (owned entries + gather),
:mod:`~dsv4_attention.cp.indexer` (local-query scoring and top-k), :mod:`~dsv4_attention.cp.rank_plan` (the rank's
attention plan).
"""

from __future__ import annotations

from dsv4_attention.cp.comm import PendingGather, all_gather_rows, start_all_gather_rows
from dsv4_attention.cp.halo import exchange_halo
from dsv4_attention.cp.layout import (
    ContextParallelLayout,
    context_parallel_layout,
    packed_context_parallel_layout,
)
from dsv4_attention.cp.plan import KindPlan, build_kind_plan, halo_rows, owned_before
from dsv4_attention.cp.rank_plan import ContextParallelPlan

__all__ = [
    "ContextParallelLayout",
    "ContextParallelPlan",
    "KindPlan",
    "PendingGather",
    "all_gather_rows",
    "build_kind_plan",
    "context_parallel_layout",
    "exchange_halo",
    "halo_rows",
    "owned_before",
    "packed_context_parallel_layout",
    "start_all_gather_rows",
]
