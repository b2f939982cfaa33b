"""Static contiguous context parallelism (CP) in the model: its group and the loss partials it computes.

Layout (upstream §4.2 "contiguous", shared with dsv4-attention): CP rank ``r`` of ``P`` holds the rows
``[r·L, (r+1)·L)`` of one DP replica's global THD pack of ``T = P·L`` rows; every CP rank gets the *global*
``PackedSeqParams``. Every loss of a CP rank (LM, MTP, the attention's indexer loss) is its partial under the one
rule of :mod:`dsv4_primitives.cp_partial_loss`, whose :func:`cp_token_count` and :func:`cp_partial_mean` this
module re-exports (public names of the model package). The batch each CP
rank feeds the model is the trainer's (``dsv4_train.context_parallel``).
"""

from __future__ import annotations

import torch.distributed as dist

from dsv4_primitives.cp_partial_loss import cp_partial_mean, cp_token_count


def context_parallel_group(pg_collection) -> dist.ProcessGroup | None:
    """The context-parallel group of ``pg_collection`` when it has more than one rank, else ``None`` (the plain
    single-rank path everywhere)."""
    cp = getattr(pg_collection, "cp", None)
    return cp if cp is not None and cp.size() > 1 else None


__all__ = ["context_parallel_group", "cp_partial_mean", "cp_token_count"]
