"""Static-shape speculative verification of one layer (:func:`extend_static_pair`, :func:`rollback_static_pair`):
two new rows per sequence ``[t, d]`` (the chosen token and its draft), the lengths a device tensor, then the
rejected second rows dropped per sequence on the device (issue 37). No host reads and no data-dependent shapes, so a
whole-model verify step (and its rollback) can be captured in a CUDA graph.

With ``n = lengths [B]`` (device int64) and ``x = [x_t (B rows); x_d (B rows)]``::

    y_t = extend_static(x_t at n)          the plain static step (writes ring slot n, the compressors' row n, ...)
    snapshot, at n + 1 per sequence:       ring slot (n + 1) mod W  [B, c]
                                           per compressor (main, indexer): the held rows (overlapping CSA: all
                                           2m rows [B, 2m, Dk], HCA: the new row's slot [B, Dk]) and the entry slot
                                           the row may complete [B, c]
    y_d = extend_static(x_d at n + 1)      reads row t from the ring / held rows like a later 1-row step does

so the rows equal two plain 1-row steps (the same ops; only the projections' row count differs). Every buffer the
second row writes is in the snapshot: ``rollback_static_pair(cache, accepted [B])`` puts the snapshot back where
``accepted`` is false (``torch.where``, every sequence, static shapes), after which the cache equals, buffer for
buffer, the cache of one plain step at ``n`` for those sequences (and of two steps for the others). The caller
advances its lengths by ``1 + accepted``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_attention.decode.compressed import CompressorCache
from dsv4_attention.decode.static import extend_static
from dsv4_attention.decode.step_indices import CompressSlots, StepIndices

__all__ = ["PairIndices", "extend_static_pair", "rollback_static_pair"]


@dataclass(frozen=True)
class PairIndices:
    """The two rows' :class:`StepIndices` of one verify step (at ``lengths`` and ``lengths + 1``), shared by every
    layer of the step (and by the draft model's layers, which sit at the same positions)."""

    first: StepIndices
    second: StepIndices

    @classmethod
    def of(cls, lengths: torch.Tensor, batch: int) -> PairIndices:
        """The pair for rows at ``lengths [B]`` and ``lengths + 1`` (a new tensor: ``lengths`` may then advance)."""
        return cls(StepIndices(lengths.clone(), batch), StepIndices(lengths + 1, batch))


@dataclass(frozen=True)
class _CompressorSnapshot:
    cache: CompressorCache
    slots: CompressSlots  # of the second row
    held_kv: torch.Tensor  # overlap: [B, 2m, Dk] every held row; else [B, Dk] the second row's slot
    held_score: torch.Tensor
    entry: torch.Tensor | None  # [B, c] the entry slot the second row may complete (None: capacity 0)


@dataclass(frozen=True)
class _PairUndo:
    indices: StepIndices  # the second row's
    ring: torch.Tensor  # [B, c] its ring slot before the row
    compressors: tuple[_CompressorSnapshot, ...]


def _snapshot(cache: CompressorCache, slots: CompressSlots) -> _CompressorSnapshot:
    b = slots.rows
    if cache.overlap:  # the held rows shift when a block completes: keep all of them (2m rows)
        kv, score = cache.held_kv.clone(), cache.held_score.clone()  # [B, 2m, Dk]
    else:
        kv, score = cache.held_kv[b, slots.slot], cache.held_score[b, slots.slot]  # [B, Dk]
    entry = cache.entries[b, slots.entry] if cache.capacity else None  # [B, c]
    return _CompressorSnapshot(cache, slots, kv, score, entry)


def _restore(snap: _CompressorSnapshot, rejected: torch.Tensor) -> None:
    cache, slots, b = snap.cache, snap.slots, snap.slots.rows
    if snap.entry is not None:
        current = cache.entries[b, slots.entry]  # [B, c]
        cache.entries[b, slots.entry] = torch.where(rejected[:, None], snap.entry, current)
    if cache.overlap:
        cache.held_kv.copy_(torch.where(rejected[:, None, None], snap.held_kv, cache.held_kv))
        cache.held_score.copy_(torch.where(rejected[:, None, None], snap.held_score, cache.held_score))
    else:
        for held, before in ((cache.held_kv, snap.held_kv), (cache.held_score, snap.held_score)):
            held[b, slots.slot] = torch.where(rejected[:, None], before, held[b, slots.slot])


@torch.no_grad()
def extend_static_pair(
    cache, attn, x: torch.Tensor, *, dense: bool = False, indices: PairIndices
) -> torch.Tensor:
    """The layer output ``[2B, d]`` of the rows ``x [2B, d]`` (rows ``0..B-1``: each sequence's row at ``n``, rows
    ``B..2B-1``: its row at ``n + 1``; ``indices``: :meth:`PairIndices.of` the device lengths ``n``). ``cache``: the
    layer's :class:`~dsv4_attention.decode.cache.AttentionCache`, which then holds ``n + 2`` rows per sequence and
    the snapshot :func:`rollback_static_pair` restores (module docstring). Host lengths are not read or changed."""
    bsz = cache.batch
    if x.dim() != 2 or x.shape[0] != 2 * bsz:
        raise ValueError(
            f"a static verify step takes two rows per sequence, x [{2 * bsz}, d] (the B first rows, then the B "
            f"second rows), got {tuple(x.shape)}"
        )
    first, second = indices.first, indices.second
    y_t = extend_static(cache, attn, x[:bsz], first.lengths, dense=dense, indices=first)  # [B, d]
    ring = cache.window
    before = ring.kv[second.rows, second.lengths.remainder(ring.window)]  # [B, c]
    parts = [cache.compressed, None if cache.indexer is None else cache.indexer.keys]
    snaps = tuple(_snapshot(c, second.compress(c.ratio, c.overlap)) for c in parts if c is not None)
    y_d = extend_static(cache, attn, x[bsz:], second.lengths, dense=dense, indices=second)  # [B, d]
    cache.pair_undo = _PairUndo(second, before, snaps)
    return torch.cat([y_t, y_d])


@torch.no_grad()
def rollback_static_pair(cache, accepted: torch.Tensor) -> None:
    """Drop the second row of the last :func:`extend_static_pair` of every sequence where ``accepted [B]`` (bool,
    device) is false: its ring slot, held compressor rows and entry slot get their values from before the row back.
    The snapshot stays (a repeated rollback is a no-op), so a captured graph may read it after the one that made it."""
    undo = cache.pair_undo
    if undo is None:
        raise ValueError("rollback_static_pair needs an extend_static_pair call on this cache first")
    if accepted.shape != (cache.batch,) or accepted.dtype != torch.bool:
        raise ValueError(
            f"accepted must be a bool tensor [{cache.batch}] (one flag per sequence), got {accepted.dtype} "
            f"{tuple(accepted.shape)}"
        )
    rejected = ~accepted  # [B]
    ring, rows = cache.window, undo.indices.rows
    slot = undo.indices.lengths.remainder(ring.window)  # [B]
    ring.kv[rows, slot] = torch.where(rejected[:, None], undo.ring, ring.kv[rows, slot])
    for snap in undo.compressors:
        _restore(snap, rejected)
