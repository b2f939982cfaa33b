"""Row chunking for the references: bound the largest intermediate, in forward AND backward.

Each chunk runs under non-reentrant activation checkpointing when gradients are needed, so backward recomputes one
chunk at a time instead of keeping every chunk's intermediates alive. Row inputs are split once with
``Tensor.split`` (one multi-output autograd node, so their gradients are concatenated once, not zero-padded per
chunk).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

# Elements of the largest per-chunk intermediate the references aim for (2^24 fp32 = 64 MiB).
DEFAULT_CHUNK_ELEMS = 1 << 24


def rows_per_chunk(per_row_elems: int, chunk_size: int | None) -> int:
    """Rows per chunk: ``chunk_size`` if given, else ``DEFAULT_CHUNK_ELEMS // per_row_elems`` (at least 1)."""
    if chunk_size is not None:
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
        return chunk_size
    return max(1, DEFAULT_CHUNK_ELEMS // max(int(per_row_elems), 1))


def map_row_chunks(
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    rows: Sequence[torch.Tensor],
    shared: Sequence[torch.Tensor],
    chunk: int,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``fn(*row_chunks, *shared)`` over row chunks of ``rows`` (all with the same leading size), concatenated.

    ``fn`` must be deterministic (it is recomputed in backward) and return tensors whose leading dim is the
    chunk's row count.
    """
    n = rows[0].shape[0]
    if n == 0:
        out = fn(*rows, *shared)
        return out
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (*rows, *shared))
    splits = [t.split(chunk) for t in rows]
    outs = []
    for i in range(len(splits[0])):
        args = [s[i] for s in splits] + list(shared)
        if need_grad and len(splits[0]) > 1:
            outs.append(checkpoint(fn, *args, use_reentrant=False))
        else:
            outs.append(fn(*args))
    if len(outs) == 1:
        return outs[0]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs))
    return torch.cat(outs)
