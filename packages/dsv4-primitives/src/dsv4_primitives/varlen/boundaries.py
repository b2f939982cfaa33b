"""``SeqBoundaries``: a packed batch's document boundaries on the device together with their host copy.

The ops that take ``cu_seqlens`` also take its host copy (``cu_seqlens_host``) and, for compressed attention, the
compressed boundaries and their host copy (``cu_seqlens_c`` / ``cu_seqlens_c_host``): with the host copies they
validate and plan without a device -> host sync. This object keeps the device tensor and its host twin together, so
they travel as one argument and cannot drift apart; :meth:`SeqBoundaries.compressed` derives the pair of a
compression ratio from the host copy (no sync; on CUDA the upload is a cached constant, see
:func:`~dsv4_primitives.varlen.upload_host_ints`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4_primitives.varlen.checks import check_cu_values, check_host_cu_seqlens
from dsv4_primitives.varlen.layout import compressed_cu_seqlens_host, cu_seqlens_from_lengths
from dsv4_primitives.varlen.upload import upload_host_ints


@dataclass(frozen=True, eq=False)
class SeqBoundaries:
    """Document boundaries of a packed (THD) batch: ``cu_seqlens`` on the device and the same values on the host.

    Attributes:
        cu_seqlens: ``[N+1]`` int32 (or int64) tensor, starts at 0, non-decreasing (empty documents allowed).
        cu_seqlens_host: the same ``N+1`` values as a tuple of Python ints.

    Build with :meth:`from_host`, :meth:`from_lengths` or :meth:`from_tensor`; the constructor validates the host
    copy and that both have ``N+1`` entries. It trusts that the values are equal (comparing would need a sync):
    build it from one source of truth. On CUDA the tensor made by :meth:`from_host` / :meth:`compressed` is a
    shared read-only constant: do not modify it in place.
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_host: tuple[int, ...]

    def __post_init__(self) -> None:
        cu = self.cu_seqlens
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
            got = f"{cu.dtype} {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise ValueError(f"SeqBoundaries.cu_seqlens must be a 1-D int32 tensor [N+1], got {got}")
        host = check_cu_values(check_host_cu_seqlens(self.cu_seqlens_host), "cu_seqlens_host")
        if len(host) != cu.numel():
            raise ValueError(
                f"SeqBoundaries: cu_seqlens_host has {len(host)} values but cu_seqlens has {cu.numel()}; "
                "build both from the same boundaries (SeqBoundaries.from_host)"
            )
        object.__setattr__(self, "cu_seqlens_host", tuple(host))

    @classmethod
    def from_host(cls, cu_seqlens_host: Sequence[int], device=None) -> SeqBoundaries:
        """From host boundaries; the device tensor is uploaded without a sync (a cached constant on CUDA)."""
        host = check_cu_values(check_host_cu_seqlens(list(cu_seqlens_host)), "cu_seqlens_host")
        return cls(upload_host_ints(host, device), tuple(host))

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], device=None) -> SeqBoundaries:
        """From host document lengths (ints >= 0)."""
        return cls.from_host(cu_seqlens_from_lengths(lengths).tolist(), device)

    @classmethod
    def from_tensor(cls, cu_seqlens: torch.Tensor) -> SeqBoundaries:
        """From a device ``cu_seqlens`` (one device -> host read to make the host copy; the tensor is kept)."""
        return cls(cu_seqlens, tuple(int(v) for v in cu_seqlens.tolist()))

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    @property
    def num_docs(self) -> int:
        """``N``, the number of documents (empty ones included)."""
        return len(self.cu_seqlens_host) - 1

    @property
    def total(self) -> int:
        """``T = cu_seqlens[-1]``, the packed rows the documents hold."""
        return self.cu_seqlens_host[-1]

    @property
    def lengths_host(self) -> tuple[int, ...]:
        """``[N]`` document lengths on the host."""
        h = self.cu_seqlens_host
        return tuple(h[i + 1] - h[i] for i in range(len(h) - 1))

    @property
    def max_seqlen(self) -> int:
        """Longest document (0 without documents)."""
        return max(self.lengths_host, default=0)

    def compressed(self, ratio: int) -> SeqBoundaries:
        """The boundaries of the ratio-``ratio`` compression: ``floor(len_i / ratio)`` entries per document (no
        device sync: derived from the host copy and uploaded as a cached constant on CUDA)."""
        return SeqBoundaries.from_host(compressed_cu_seqlens_host(self.cu_seqlens_host, ratio), self.device)

    def to(self, device) -> SeqBoundaries:
        """The same boundaries with the tensor on ``device`` (from the host copy: no sync)."""
        return SeqBoundaries.from_host(self.cu_seqlens_host, device)

    def host_kwargs(self, prefix: str = "cu_seqlens") -> dict:
        """``{prefix: tensor, prefix + "_host": list}``: the keyword pair the ops take (e.g. ``cu_seqlens_c``)."""
        return {prefix: self.cu_seqlens, f"{prefix}_host": list(self.cu_seqlens_host)}
