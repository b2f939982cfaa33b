"""``StepIndices``: the index tensors of one decode step that depend only on the new rows' positions, built once per
step and shared by every attention layer of the model (issue 37).

A batch-1 decode step on a GPU is launch bound: every small index op is a kernel launch paid on the host. The
window slots, the visible-entry masks and the compressors' held slots of a step are the same for every layer of a
kind (all layers hold the same lengths), so one :class:`StepIndices` per step builds each of them on its first use
and hands the same tensors to the next layers::

    window(W)              int32 [R, W]   ring slots / step rows of the combined key buffer (static_window_indices)
    visible(m, C)          int64 [R, C]   entry slots b * C + w, -1 unless w < floor((n + 1) / m)
    compress(m, overlap)   CompressSlots  the held slot of the new row, the entry a completing row emits, ...
    attention(W, m, C)     int32 [R, W + C]  window slots + visible entries (HCA, CSA's dense phase)

``lengths [R]`` (the rows' positions) must not change while the step runs: the eager step passes a copy, the static
step its length buffer (advanced after the whole forward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv4_attention._kernels import attention_indices


def _row_sequences(lengths: torch.Tensor, sequences: torch.Tensor | None) -> torch.Tensor:
    """int64 ``[R]``: the sequence of every row (``None``: one row per sequence, in order)."""
    return torch.arange(lengths.shape[0], device=lengths.device) if sequences is None else sequences


def static_window_indices(
    lengths: torch.Tensor, window: int, sequences: torch.Tensor | None = None, batch: int | None = None
) -> torch.Tensor:
    """int32 ``[R, W]``: the window slots of each row at position ``lengths[r]`` of sequence ``sequences[r]``
    (``None``: row ``b`` of sequence ``b``) as rows of the combined key buffer of ``batch`` sequences (default
    ``R``; :mod:`~dsv4_attention.decode.static`: the step's row ``r`` is key ``B W + r``)."""
    seq = _row_sequences(lengths, sequences)[:, None]  # [R, 1]
    r = torch.arange(lengths.shape[0], device=lengths.device)[:, None]  # [R, 1]
    bsz = lengths.shape[0] if batch is None else batch
    s = lengths[:, None] + torch.arange(1 - window, 1, device=lengths.device)[None, :]  # [R, W] key positions
    idx = torch.where(s == lengths[:, None], bsz * window + r, seq * window + s.remainder(window))
    return torch.where(s >= 0, idx, -1).to(torch.int32)


def static_visible_entries(
    lengths: torch.Tensor, ratio: int, capacity: int, sequences: torch.Tensor | None = None
) -> torch.Tensor:
    """int64 ``[R, C]``: every entry slot ``b * C + w`` of each row's sequence ``b``, ``-1`` unless ``w < floor((n
    + 1) / m)`` at the row's position ``n`` (spec §3.4; the static form of
    :func:`~dsv4_attention.decode.cache.visible_entries`)."""
    w = torch.arange(capacity, device=lengths.device)[None, :]  # [1, C]
    rows = _row_sequences(lengths, sequences)[:, None] * capacity + w  # [R, C]
    return torch.where(w < ((lengths + 1) // ratio)[:, None], rows, -1)


@dataclass(frozen=True)
class CompressSlots:
    """Where one compressor reads and writes for the step's rows (:func:`~dsv4_attention.decode.static.
    compress_static`; ``m`` the ratio, ``n`` a row's position, ``start(n)`` its first held position)."""

    rows: torch.Tensor  # [R] the rows' sequences
    slot: torch.Tensor  # [R] held slot of the new row: n - start(n)
    entry: torch.Tensor  # [R] the entry a completing row emits, w = (n + 1) / m - 1 clamped at 0
    entry_position: torch.Tensor  # [R] its RoPE position w m
    complete: torch.Tensor  # [R, 1] bool: the row completes a block
    first: torch.Tensor  # [R, 1] bool: w == 0 (an overlapping compressor pools the document's entry 0)
    shift: torch.Tensor | None  # [R, 1, 1] bool: the completed block becomes the held previous one (overlap)
    subset: bool  # the rows are a subset of the sequences (``rows`` not every sequence in order)


class StepIndices:
    """The position-derived index tensors of one decode step (module docstring), built on first use.

    Args:
        lengths: int64 ``[R]`` the rows' positions (fixed while the step runs).
        batch: ``B`` sequences of the caches.
        sequences: int64 ``[R]`` the rows' distinct sequences; ``None``: every sequence, in order (``R = B``).
    """

    def __init__(self, lengths: torch.Tensor, batch: int, sequences: torch.Tensor | None = None) -> None:
        self.lengths = lengths
        self.batch = batch
        self.sequences = sequences
        self._tables: dict[tuple, object] = {}

    def _get(self, key: tuple, build: Callable[[], object]):
        out = self._tables.get(key)
        if out is None:
            out = self._tables[key] = build()
        return out

    @property
    def rows(self) -> torch.Tensor:
        """int64 ``[R]``: the sequence of every row."""
        return self._get(("rows",), lambda: _row_sequences(self.lengths, self.sequences))

    def window(self, window: int) -> torch.Tensor:
        """int32 ``[R, W]`` (:func:`static_window_indices`)."""
        return self._get(
            ("window", window),
            lambda: static_window_indices(self.lengths, window, self.sequences, self.batch),
        )

    def visible(self, ratio: int, capacity: int) -> torch.Tensor:
        """int64 ``[R, C]`` (:func:`static_visible_entries`)."""
        return self._get(
            ("visible", ratio, capacity),
            lambda: static_visible_entries(self.lengths, ratio, capacity, self.sequences),
        )

    def attention(self, window: int, ratio: int, capacity: int) -> torch.Tensor:
        """int32 ``[R, W + C]``: the window slots and every visible entry (``attention_indices``), the whole index
        list of an HCA layer (and of CSA's dense phase)."""

        def build() -> torch.Tensor:
            offset = self.batch * window + self.batch  # the entries follow the ring and the step rows
            return attention_indices(self.window(window), self.visible(ratio, capacity), offset)

        return self._get(("attention", window, ratio, capacity), build)

    def compress(self, ratio: int, overlap: bool) -> CompressSlots:
        """The held slot and the emitted entry of every row for a compressor of ``ratio`` (:class:`CompressSlots`)."""

        def build() -> CompressSlots:
            n, m = self.lengths, ratio
            block = n // m * m
            start = (block - m).clamp(min=0) if overlap else block
            w = (n + 1) // m - 1  # [R]
            complete = ((n + 1) % m == 0)[:, None]  # [R, 1]
            entry = w.clamp(min=0)
            first = (w == 0)[:, None]
            shift = (complete & ~first)[:, :, None] if overlap else None  # (complete: w >= 0)
            subset = self.sequences is not None
            return CompressSlots(self.rows, n - start, entry, entry * m, complete, first, shift, subset)

        return self._get(("compress", ratio, overlap), build)
