"""Device-side document bounds with host capacities: the CUDA-graph ("static-shape THD") mode of the varlen ops.

The default (host-bounds) mode of every op takes the host copy of ``cu_seqlens`` (``cu_seqlens_host``): the
launchers size grids, plan row blocks and allocate outputs from it, which is fast and sync-free, but a CUDA graph
captured on one pack would replay that pack's boundaries forever. In this mode the boundaries exist only on the
device and every shape comes from host *capacities* that do not change between packs:

* ``T`` rows (the pack is padded to the static row capacity; ``cu_seqlens[-1] == T``: the tail is a segment);
* ``N_cap + 1`` entries of ``cu_seqlens`` (unused document slots repeat the end: empty documents);
* ``T // ratio`` compressed entries per ratio, an upper bound of ``sum_i floor(len_i / ratio)`` (a sum of floors
  never exceeds the floor of the sum); entries ``cu_seqlens_c[-1] .. T // ratio - 1`` are padding rows that no
  index ever points to (zero-pooled, finite).

Everything derived from the boundaries (compressed ``cu_seqlens``, document ids, entry positions, index maps) is
computed here from the device tensor with fixed-shape tensor ops: no ``.item()``, ``.tolist()`` or host-to-device
copy, so the ops can be captured once and replayed on packs with other boundaries. Row and entry values equal those
of the host-bounds mode (the padding rows and columns are extra); the ops' static forms are in
:mod:`csa_kernels.ops.compressor.static` and :mod:`csa_kernels.ops.indexer.static`.

Shape legend: ``T`` rows, ``N`` document slots (``N_cap``), ``Tc`` entry capacity ``T // ratio``, ``W`` window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from csa_kernels._checks import check_ratio
from csa_kernels.ops.visibility.rules import visible_rows, window_rows


@dataclass(frozen=True, eq=False)
class StaticBounds:
    """Document boundaries of a static-shape THD pack, on the device only.

    Attributes:
        cu_seqlens: int32 ``[N_cap + 1]`` on the device (starts at 0, non-decreasing, ends at ``total``; unused
            slots repeat the end). Trusted: its values are not checked (that would read them back).
        total: ``T``, the packed rows (a host capacity, the same for every pack).
    """

    cu_seqlens: torch.Tensor
    total: int
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        cu = self.cu_seqlens
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2:
            got = tuple(cu.shape) if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise ValueError(
                f"StaticBounds.cu_seqlens must be a 1-D int tensor [N_cap + 1] (N_cap >= 1), got {got}"
            )
        if cu.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"StaticBounds.cu_seqlens must be int32 (or int64), got {cu.dtype}")
        if not isinstance(self.total, int) or isinstance(self.total, bool) or self.total < 0:
            raise ValueError(f"StaticBounds.total must be an int >= 0 (the row capacity), got {self.total!r}")

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    @property
    def max_docs(self) -> int:
        """``N_cap``: document slots (host capacity)."""
        return self.cu_seqlens.numel() - 1

    def entry_capacity(self, ratio: int) -> int:
        """``T // ratio``: rows of every compressed buffer of ``ratio`` (host capacity)."""
        check_ratio(ratio)
        return self.total // ratio

    def _memo(self, key, fn):
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    @property
    def cu64(self) -> torch.Tensor:
        """``cu_seqlens`` as int64 ``[N_cap + 1]``."""
        return self._memo("cu64", lambda: self.cu_seqlens.to(torch.int64))

    def compressed(self, ratio: int) -> torch.Tensor:
        """int32 ``[N_cap + 1]`` ``cu_seqlens_c`` of ``ratio``: ``floor(len_i / ratio)`` entries per document."""
        check_ratio(ratio)
        return self._memo(("cuc", ratio), lambda: _compressed(self.cu64, ratio))

    def document_ids(self) -> torch.Tensor:
        """int64 ``[T]`` document slot of every row."""
        return self._memo("doc", lambda: _doc_ids(self.cu64, self.total))

    def positions(self) -> torch.Tensor:
        """int64 ``[T]`` document-relative position of every row."""
        return self._memo(
            "pos", lambda: torch.arange(self.total, device=self.device) - self.cu64[self.document_ids()]
        )

    def entry_positions(self, ratio: int) -> torch.Tensor:
        """int64 ``[T // ratio]`` document-relative position ``w * ratio`` of each entry's first token (padding
        entries continue counting from the start of the last document: finite, below ``T``)."""

        def build():
            cuc = self.compressed(ratio).to(torch.int64)
            cap = self.entry_capacity(ratio)
            e = torch.arange(cap, device=self.device)
            doc = torch.searchsorted(cuc[1:], e, right=True).clamp_(max=cuc.numel() - 2)  # [Tc]
            return (e - cuc[doc]) * ratio

        return self._memo(("epos", ratio), build)


def _compressed(cu64: torch.Tensor, ratio: int) -> torch.Tensor:
    lens = (cu64[1:] - cu64[:-1]) // ratio  # [N]
    out = torch.zeros(cu64.numel(), dtype=torch.int64, device=cu64.device)
    out[1:] = torch.cumsum(lens, 0)
    return out.to(torch.int32)


def _doc_ids(cu64: torch.Tensor, total: int) -> torch.Tensor:
    rows = torch.arange(total, device=cu64.device, dtype=torch.int64)  # [T]
    return torch.searchsorted(cu64[1:], rows, right=True).clamp_(max=cu64.numel() - 2)


def window_indices_static(bounds: StaticBounds, window: int) -> torch.Tensor:
    """``[T, W]`` int32: :func:`csa_kernels.window_indices` of the bounds (same values), without a host read."""
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    return bounds._memo(("win", window), lambda: window_rows(bounds.cu64, bounds.document_ids(), window))


def visible_compressed_indices_static(bounds: StaticBounds, ratio: int) -> torch.Tensor:
    """``[T, T // ratio]`` int32: :func:`csa_kernels.visible_compressed_indices` of the bounds at the entry
    capacity width (same values in the first ``max_entries`` columns, ``-1`` after), without a host read."""
    cap = bounds.entry_capacity(ratio)
    return bounds._memo(
        ("vis", ratio),
        lambda: visible_rows(bounds.cu64, bounds.compressed(ratio), bounds.document_ids(), ratio, cap),
    )


def row_block_table(
    bounds: StaticBounds, ratio: int, block_t: int, row0: int = 0, row1: int | None = None
) -> torch.Tensor:
    """int32 ``[5, S]`` row blocks of the rows ``[row0, row1)`` (blocks of at most ``block_t`` rows that never
    straddle a document): ``(t0, t1, document position of t0, first entry of the document, its entries)`` per slot.

    ``S = ceil((row1 - row0) / block_t) + N_cap`` is a host capacity (each document adds at most one partial block);
    unused slots are ``(0, 0, 0, 0, 0)`` (empty: the kernels skip them). For ``row0 = 0, row1 = T`` the used slots
    equal the host-bounds plan (``csa_kernels.ops.indexer.triton._row_blocks``), in the same order.
    """
    row1 = bounds.total if row1 is None else row1
    return bounds._memo(
        ("rows", ratio, block_t, row0, row1), lambda: _row_blocks(bounds, ratio, block_t, row0, row1)
    )


def _row_blocks(bounds: StaticBounds, ratio: int, block_t: int, row0: int, row1: int) -> torch.Tensor:
    cu = bounds.cu64
    cuc = bounds.compressed(ratio).to(torch.int64)
    s = cu[:-1].clamp(row0, row1)  # [N] clipped document starts
    e = cu[1:].clamp(row0, row1)
    nblk = (e - s + block_t - 1) // block_t  # [N]
    blk_end = torch.cumsum(nblk, 0)  # [N]
    n_slots = -(-(row1 - row0) // block_t) + bounds.max_docs
    slot = torch.arange(n_slots, device=cu.device, dtype=torch.int64)  # [S]
    doc = torch.searchsorted(blk_end, slot, right=True)  # [S] (N on unused slots)
    used = doc < nblk.numel()
    d = doc.clamp(max=nblk.numel() - 1)
    t0 = s[d] + (slot - (blk_end[d] - nblk[d])) * block_t
    t1 = torch.minimum(t0 + block_t, e[d])
    cols = (t0, t1, t0 - cu[d], cuc[d], cuc[d + 1] - cuc[d])
    return torch.stack([torch.where(used, c, 0) for c in cols]).to(torch.int32)


__all__ = [
    "StaticBounds",
    "row_block_table",
    "visible_compressed_indices_static",
    "window_indices_static",
]
