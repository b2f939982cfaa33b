"""Static contiguous context-parallel layout (upstream §4.2 "contiguous"): rank ``r`` of ``cp`` owns the rows
``[r * L, (r + 1) * L)`` of the global padded THD buffer, ``L = T / cp``. Documents may straddle rank boundaries;
the *global* ``PackedSeqs`` stays the source of truth for boundaries and positions.
"""

from __future__ import annotations

import torch


def contiguous_cp_interval(total_tokens: int, cp_rank: int, cp_size: int) -> tuple[int, int]:
    """``(start, stop)`` global rows owned by ``cp_rank``; ``total_tokens`` must be a multiple of ``cp_size``."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"need 0 <= cp_rank < cp_size, got cp_rank={cp_rank}, cp_size={cp_size}")
    if total_tokens % cp_size:
        raise ValueError(
            f"total_tokens={total_tokens} is not a multiple of cp_size={cp_size}; pad the pack to a multiple of "
            "cp_size (static shapes: token_capacity = max_seqlen_per_dp_cp_rank * cp_size)"
        )
    local = total_tokens // cp_size
    return cp_rank * local, (cp_rank + 1) * local


def shard_contiguous_cp(x: torch.Tensor, cp_rank: int, cp_size: int, *, dim: int = 0) -> torch.Tensor:
    """The rows of ``x`` (packed along ``dim``) owned by ``cp_rank`` (a view)."""
    start, stop = contiguous_cp_interval(x.size(dim), cp_rank, cp_size)
    return x.narrow(dim, start, stop - start)
