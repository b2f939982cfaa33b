"""``SeqBoundaries``: the one object that carries a packed batch's document boundaries through the ops.

Two modes, one type:

* **host** (the default): the device ``cu_seqlens`` and the same values on the host (``cu_seqlens_host``). The ops
  validate and plan from the host copy (grid sizes, output rows, document loops): no device -> host sync.
* **static** (CUDA graphs, static-shape THD): the boundaries exist on the device only (``cu_seqlens_host`` is
  ``None``) and the host knows a *capacity*: the rows of every buffer (``total``), the same for every pack.
  ``cu_seqlens[-1] <= total`` (the host value is an upper bound, never read back); ``N + 1`` slots where unused
  ones repeat the end (empty documents). Every shape comes from the capacities, everything derived (compressed
  boundaries, document ids, positions, index maps) is computed with fixed-shape device ops, so an op captured on
  one pack replays correctly on another.

:meth:`SeqBoundaries.compressed` derives the boundaries of a compression ratio (``floor(len_i / ratio)`` entries per
document) in the same mode: host lists (no sync) or device ops with the entry capacity ``total // ratio`` (a sum of
floors never exceeds the floor of the sum). Derived device tensors are memoised on the object (it is immutable).

Shape legend: ``N`` documents (slots), ``T`` rows (``total``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dsv4_primitives.varlen.checks import check_cu_values, check_host_cu_seqlens, check_ratio
from dsv4_primitives.varlen.layout import compressed_cu_seqlens_host, cu_seqlens_from_lengths
from dsv4_primitives.varlen.upload import upload_host_ints


@dataclass(frozen=True, eq=False)
class SeqBoundaries:
    """Document boundaries of a packed (THD) batch.

    Attributes:
        cu_seqlens: ``[N+1]`` int32 (or int64) device tensor, starts at 0, non-decreasing (empty documents allowed).
        cu_seqlens_host: host mode: the same ``N+1`` values as a tuple of Python ints; static mode: ``None``.
        capacity: static mode: the row capacity ``T`` (host int, ``>= cu_seqlens[-1]``); host mode: ``None``.

    Build with :meth:`from_host`, :meth:`from_lengths`, :meth:`from_tensor` (host mode) or :meth:`static`; the
    constructor validates the host copy (host mode) or the capacity (static mode). It trusts that the device and
    host values are equal (comparing would need a sync): build both from one source of truth. On CUDA the tensor
    made by :meth:`from_host` / :meth:`compressed` is a shared read-only constant: do not modify it in place.
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_host: tuple[int, ...] | None = None
    capacity: int | None = None
    _derived: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        cu = self.cu_seqlens
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
            got = f"{cu.dtype} {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise ValueError(f"SeqBoundaries.cu_seqlens must be a 1-D int32 tensor [N+1], got {got}")
        if (self.cu_seqlens_host is None) == (self.capacity is None):
            raise ValueError(
                "SeqBoundaries needs exactly one of cu_seqlens_host (host mode) and capacity (static mode); build "
                "it with SeqBoundaries.from_host / from_tensor or SeqBoundaries.static"
            )
        if self.capacity is not None:
            cap = self.capacity
            if not isinstance(cap, int) or isinstance(cap, bool) or cap < 0:
                raise ValueError(
                    f"SeqBoundaries.capacity must be an int >= 0 (the row capacity), got {cap!r}"
                )
            if cu.numel() < 2:
                raise ValueError(
                    f"static SeqBoundaries need at least one document slot (cu_seqlens [N+1], N >= 1), got "
                    f"{tuple(cu.shape)}"
                )
            return
        host = check_cu_values(check_host_cu_seqlens(self.cu_seqlens_host), "cu_seqlens_host")
        if len(host) != cu.numel():
            raise ValueError(
                f"SeqBoundaries: cu_seqlens_host has {len(host)} values but cu_seqlens has {cu.numel()}; "
                "build both from the same boundaries (SeqBoundaries.from_host)"
            )
        object.__setattr__(self, "cu_seqlens_host", tuple(host))

    @classmethod
    def from_host(cls, cu_seqlens_host: Sequence[int], device=None) -> SeqBoundaries:
        """Host mode from host boundaries; the device tensor is uploaded without a sync (a cached constant on
        CUDA)."""
        host = check_cu_values(check_host_cu_seqlens(list(cu_seqlens_host)), "cu_seqlens_host")
        return cls(upload_host_ints(host, device), tuple(host))

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], device=None) -> SeqBoundaries:
        """Host mode from host document lengths (ints >= 0)."""
        return cls.from_host(cu_seqlens_from_lengths(lengths).tolist(), device)

    @classmethod
    def from_tensor(cls, cu_seqlens: torch.Tensor) -> SeqBoundaries:
        """Host mode from a device ``cu_seqlens`` (one device -> host read makes the host copy; the tensor is
        kept)."""
        if not isinstance(cu_seqlens, torch.Tensor):
            raise ValueError(
                f"cu_seqlens must be a torch.Tensor (int32 [N+1]), got {type(cu_seqlens).__name__}"
            )
        return cls(cu_seqlens, tuple(int(v) for v in cu_seqlens.tolist()))

    @classmethod
    def static(cls, cu_seqlens: torch.Tensor, capacity: int) -> SeqBoundaries:
        """Static mode: ``cu_seqlens [N+1]`` stays on the device (trusted, never read back); ``capacity`` rows.

        Token boundaries given to the attention ops end at the capacity (``cu_seqlens[-1] == capacity``: a
        static-shape tail is a segment of its own); derived boundaries (:meth:`compressed`) may end before it
        (the rows past their end are padding that no index points to)."""
        return cls(cu_seqlens, None, capacity)

    @property
    def is_static(self) -> bool:
        """Static mode (device-only boundaries, capacity shapes: the CUDA-graph path)."""
        return self.capacity is not None

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    @property
    def host(self) -> tuple[int, ...]:
        """The host copy; ``ValueError`` in static mode (reading the device values back would bake one pack's
        boundaries into a CUDA graph)."""
        if self.cu_seqlens_host is None:
            raise ValueError(
                "static SeqBoundaries keep their boundaries on the device only (no host copy); use the capacity "
                "(total, max_entries) or SeqBoundaries.exact() outside a CUDA graph"
            )
        return self.cu_seqlens_host

    @property
    def num_docs(self) -> int:
        """``N``, the number of documents (static mode: document slots; empty ones included)."""
        return self.cu_seqlens.numel() - 1

    @property
    def total(self) -> int:
        """``T``, the rows of the buffers these boundaries index: ``cu_seqlens[-1]`` (host mode) or the capacity."""
        return self.capacity if self.capacity is not None else self.cu_seqlens_host[-1]

    @property
    def lengths_host(self) -> tuple[int, ...]:
        """``[N]`` document lengths on the host (host mode only)."""
        h = self.host
        return tuple(h[i + 1] - h[i] for i in range(len(h) - 1))

    @property
    def max_seqlen(self) -> int:
        """Longest document (0 without documents); static mode: the capacity (an upper bound)."""
        if self.capacity is not None:
            return self.capacity
        return max(self.lengths_host, default=0)

    def max_entries(self, ratio: int) -> int:
        """The largest per-document compressed entry count ``floor(len / ratio)`` (host int, no sync); static mode:
        the entry capacity ``total // ratio`` (the width of every entry index map and score matrix)."""
        check_ratio(ratio)
        if self.capacity is not None:
            return self.capacity // ratio
        return max((b - a for a, b in itertools.pairwise(self.cu_seqlens_host)), default=0) // ratio

    def compressed(self, ratio: int) -> SeqBoundaries:
        """The boundaries of the ratio-``ratio`` compression (``floor(len_i / ratio)`` entries per document), in
        the same mode: host mode from the host copy (uploaded as a cached constant on CUDA), static mode on the
        device with capacity ``total // ratio``. No device sync either way; memoised."""
        check_ratio(ratio)

        def build() -> SeqBoundaries:
            if self.capacity is None:
                return SeqBoundaries.from_host(
                    compressed_cu_seqlens_host(self.cu_seqlens_host, ratio), self.device
                )
            cu = self.cu64
            out = torch.zeros(cu.numel(), dtype=torch.int64, device=cu.device)  # [N+1]
            out[1:] = torch.cumsum((cu[1:] - cu[:-1]) // ratio, 0)
            return SeqBoundaries.static(out.to(torch.int32), self.capacity // ratio)

        return self.derived(("compressed", ratio), build)

    def exact(self) -> SeqBoundaries:
        """Host mode of the same boundaries: ``self`` in host mode; static mode reads ``cu_seqlens`` back (one
        sync; never inside a CUDA graph: what the CPU reference paths of the ops use)."""
        return self if self.capacity is None else SeqBoundaries.from_tensor(self.cu_seqlens)

    def to(self, device) -> SeqBoundaries:
        """The same boundaries with the tensor on ``device`` (host mode: from the host copy, no sync)."""
        if self.capacity is not None:
            return SeqBoundaries.static(self.cu_seqlens.to(device), self.capacity)
        return SeqBoundaries.from_host(self.cu_seqlens_host, device)

    @property
    def cu64(self) -> torch.Tensor:
        """``cu_seqlens`` as int64 ``[N+1]`` (memoised)."""
        return self.derived("cu64", lambda: self.cu_seqlens.to(torch.int64))

    def document_ids(self) -> torch.Tensor:
        """int64 ``[T]`` document of every row (rows past ``cu_seqlens[-1]`` count to the last document); no sync."""

        def build() -> torch.Tensor:
            rows = torch.arange(self.total, device=self.device, dtype=torch.int64)  # [T]
            return torch.searchsorted(self.cu64[1:], rows, right=True).clamp_(max=max(self.num_docs - 1, 0))

        return self.derived("document_ids", build)

    def positions(self) -> torch.Tensor:
        """int64 ``[T]`` document-relative position of every row (rows past ``cu_seqlens[-1]`` continue counting
        from the start of the last document: finite, below ``T``); no sync."""

        def build() -> torch.Tensor:
            rows = torch.arange(self.total, device=self.device, dtype=torch.int64)  # [T]
            if self.num_docs == 0:
                return rows
            return rows - self.cu64[self.document_ids()]

        return self.derived("positions", build)

    def derived(self, key, build: Callable[[], object]):
        """``build()`` memoised on these boundaries under ``key`` (index maps and plans derived from them: the
        boundaries are immutable, so are their derivations). Not memoised under ``torch.inference_mode`` (an
        inference tensor could never be saved for a later backward)."""
        hit = self._derived.get(key)
        if hit is not None:
            return hit
        value = build()
        if not torch.is_inference_mode_enabled():
            self._derived[key] = value
        return value
