"""Tensor parallelism with sequence parallelism for DSv4 attention (issue 31), exact against TP=1.

Heads, their per-head sinks and the grouped output projection are split over the TP ranks (``AttentionConfig(...,
tp_size=P)`` builds one rank's shard; :mod:`~dsv4_attention.tp.params` says which dim of which parameter); the
token-local half (``q_down``, the shared KV head, the compressors, the lightning indexer) is replicated and runs on
the rank's sequence-parallel slice with the context-parallel machinery over the TP group. Build the rank's
:class:`TensorParallelLayout` from the GLOBAL layout and call ``DSv4Attention.forward(x_local [L, d], tp_layout)``:
the output is this rank's rows ``[L, d]`` (reduce-scattered), the indexer loss this rank's partial. The plan:
:class:`~dsv4_attention.tp.plan.TensorParallelPlan`. With context parallelism too, build the layout with
:func:`tensor_context_parallel_layout` (TP, CP and TP x CP groups): rank ``(c, t)`` holds rows
``[(c*TP + t)*L, (c*TP + t + 1)*L)``.
"""

from __future__ import annotations

from dsv4_attention.tp.comm import gather_ids, gather_rows, logsumexp_to_rows, reduce_scatter_rows
from dsv4_attention.tp.layout import (
    TensorParallelLayout,
    tensor_context_parallel_layout,
    tensor_parallel_layout,
)
from dsv4_attention.tp.params import HEAD_SPLIT, mark_tensor_parallel, shard_of
from dsv4_attention.tp.plan import TensorParallelPlan

__all__ = [
    "HEAD_SPLIT",
    "TensorParallelLayout",
    "TensorParallelPlan",
    "gather_ids",
    "gather_rows",
    "logsumexp_to_rows",
    "mark_tensor_parallel",
    "reduce_scatter_rows",
    "shard_of",
    "tensor_context_parallel_layout",
    "tensor_parallel_layout",
]
