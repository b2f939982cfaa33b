"""Position ids for the three layouts: SBHD (0..S-1 per sequence), packed THD (restart at each document), explicit."""

from __future__ import annotations

import torch

from dsv4_primitives.varlen import document_positions


def positions_sbhd(seq_len: int, batch: int = 1, device=None) -> torch.Tensor:
    """``[S, B]`` int64 positions ``0 .. S-1`` for every sequence of an SBHD batch."""
    return torch.arange(seq_len, device=device, dtype=torch.int64)[:, None].expand(seq_len, batch)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Document-relative positions ``[T]`` (int64) of a packed THD batch.

    ``cu_seqlens`` is int32/int64 ``[N+1]``, non-decreasing, starting at 0 (empty documents allowed). Tokens past
    ``cu_seqlens[-1]`` (static-shape padding up to ``total``) continue counting from the last document's start
    (:func:`dsv4_primitives.varlen.document_positions` after the checks; one device -> host read of the end).
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D [N+1], got shape {tuple(cu_seqlens.shape)}")
    end = int(cu_seqlens[-1])
    total = end if total is None else int(total)
    if total < end:
        raise ValueError(f"total={total} is smaller than cu_seqlens[-1]={end}")
    return document_positions(cu_seqlens, total)
