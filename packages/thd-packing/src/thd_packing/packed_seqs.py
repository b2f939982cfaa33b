"""``PackedSeqs``: the metadata of one packed THD buffer, convertible to and from megatron-core's ``PackedSeqParams``.

A packed buffer holds ``T`` rows. Document ``i`` (``0 <= i < N``) owns the padded row interval
``[cu_seqlens_padded[i], cu_seqlens_padded[i+1])``; its first ``cu_seqlens[i+1] - cu_seqlens[i]`` rows are real
tokens, the rest of the interval is per-document padding (alignment). Rows at or past ``cu_seqlens_padded[-1]``
(up to ``T``) belong to no document: the buffer's tail padding. Empty documents (repeated boundaries) are allowed.

Shape legend: ``T`` rows in the buffer, ``N`` documents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dsv4_primitives import positions_from_cu_seqlens
from dsv4_primitives.extras import require_megatron
from dsv4_primitives.varlen import cu_seqlens_from_lengths, document_ids

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams


def _as_cu(name: str, cu: torch.Tensor | Sequence[int]) -> torch.Tensor:
    t = torch.as_tensor(cu)
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    if t.dim() != 1 or t.numel() < 1:
        raise ValueError(f"{name} must be 1-D [N+1] with at least one entry, got shape {tuple(t.shape)}")
    t = t.to(torch.int32)
    if int(t[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(t[0])}")
    if t.numel() > 1 and bool((t[1:] < t[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing, got {t.tolist()}")
    return t


def round_up(x: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is ``>= x``."""
    return -(-x // multiple) * multiple


@dataclass(frozen=True, eq=False)
class PackedSeqs:
    """Metadata of a packed THD buffer (see the module docstring for the row layout).

    Attributes:
        cu_seqlens: ``[N+1]`` int32, cumulative *real* lengths.
        cu_seqlens_padded: ``[N+1]`` int32, cumulative *padded* lengths (row offsets into the buffer).
        max_seqlen: host int, an upper bound of every padded document length (what attention kernels take).
        total_tokens: host int ``T``, rows in the buffer (``>= cu_seqlens_padded[-1]``).
        position_ids: ``[T]`` int64, document-relative positions derived from ``cu_seqlens_padded``.
        seq_ids: ``[T]`` int32, the document index of each row, ``-1`` on tail rows past ``cu_seqlens_padded[-1]``.

    Build with :meth:`from_lengths` or :meth:`from_cu_seqlens`; the constructor validates its inputs.
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    total_tokens: int
    position_ids: torch.Tensor = field(repr=False)
    seq_ids: torch.Tensor = field(repr=False)

    @classmethod
    def from_cu_seqlens(
        cls,
        cu_seqlens: torch.Tensor | Sequence[int],
        cu_seqlens_padded: torch.Tensor | Sequence[int] | None = None,
        *,
        total_tokens: int | None = None,
        max_seqlen: int | None = None,
    ) -> PackedSeqs:
        """Validate boundaries and derive ``position_ids`` / ``seq_ids``.

        ``cu_seqlens_padded`` defaults to ``cu_seqlens`` (no per-document padding); ``total_tokens`` defaults to
        ``cu_seqlens_padded[-1]``; ``max_seqlen`` defaults to the longest padded document (at least 1).
        """
        cu = _as_cu("cu_seqlens", cu_seqlens)
        cu_pad = cu if cu_seqlens_padded is None else _as_cu("cu_seqlens_padded", cu_seqlens_padded)
        cu_pad = cu_pad.to(cu.device)
        if cu_pad.numel() != cu.numel():
            raise ValueError(
                f"cu_seqlens has {cu.numel()} entries but cu_seqlens_padded has {cu_pad.numel()}; "
                "both must be [N+1] for the same N documents"
            )
        real = cu[1:] - cu[:-1]
        padded = cu_pad[1:] - cu_pad[:-1]
        if bool((real > padded).any()):
            bad = int(torch.nonzero(real > padded)[0])
            raise ValueError(
                f"document {bad} has real length {int(real[bad])} > padded length {int(padded[bad])}; "
                "cu_seqlens_padded must pad each document to at least its real length"
            )
        end = int(cu_pad[-1])
        total = end if total_tokens is None else int(total_tokens)
        if total < end:
            raise ValueError(
                f"total_tokens={total} is smaller than cu_seqlens_padded[-1]={end}; the buffer must hold every "
                "padded document"
            )
        longest = int(padded.max()) if padded.numel() else 0
        if max_seqlen is None:
            max_seqlen = max(longest, 1)
        elif int(max_seqlen) < longest:
            raise ValueError(
                f"max_seqlen={max_seqlen} is smaller than the longest padded document ({longest})"
            )
        seq_ids = document_ids(cu_pad, total, tail=-1).to(torch.int32)
        position_ids = positions_from_cu_seqlens(cu_pad, total)
        return cls(cu, cu_pad, int(max_seqlen), total, position_ids, seq_ids)

    @classmethod
    def from_lengths(
        cls,
        lengths: Sequence[int] | torch.Tensor,
        padded_lengths: Sequence[int] | torch.Tensor | None = None,
        *,
        alignment: int = 1,
        total_tokens: int | None = None,
        max_seqlen: int | None = None,
        device=None,
    ) -> PackedSeqs:
        """Pack documents of ``lengths`` back to back, each padded to ``padded_lengths`` or to a multiple of
        ``alignment`` (an empty document stays empty)."""
        if alignment < 1:
            raise ValueError(f"alignment must be >= 1, got {alignment}")
        lens = torch.as_tensor(lengths, dtype=torch.int64).reshape(-1)
        if padded_lengths is None:
            padded = (lens + alignment - 1) // alignment * alignment
        else:
            if alignment != 1:
                raise ValueError("pass either padded_lengths or alignment, not both")
            padded = torch.as_tensor(padded_lengths, dtype=torch.int64).reshape(-1)
            if padded.numel() != lens.numel():
                raise ValueError(
                    f"padded_lengths has {padded.numel()} entries but lengths has {lens.numel()}"
                )
        return cls.from_cu_seqlens(
            cu_seqlens_from_lengths(lens, device),
            cu_seqlens_from_lengths(padded, device),
            total_tokens=total_tokens,
            max_seqlen=max_seqlen,
        )

    @classmethod
    def from_packed_seq_params(
        cls, params: PackedSeqParams, *, total_tokens: int | None = None
    ) -> PackedSeqs:
        """Read a megatron-core ``PackedSeqParams`` with ``qkv_format='thd'`` (self-attention: q and kv equal).

        ``total_tokens`` defaults to ``params.total_tokens`` when set, else to ``cu_seqlens_q_padded[-1]``.
        """
        if params.qkv_format != "thd":
            raise ValueError(f"PackedSeqParams.qkv_format must be 'thd', got {params.qkv_format!r}")
        if params.cu_seqlens_q is None:
            raise ValueError("PackedSeqParams.cu_seqlens_q is None; a THD pack needs cumulative lengths")
        for q, kv in (("cu_seqlens_q", "cu_seqlens_kv"), ("cu_seqlens_q_padded", "cu_seqlens_kv_padded")):
            a, b = getattr(params, q), getattr(params, kv)
            if b is not None and (a is None or not torch.equal(a.to(torch.int64), b.to(torch.int64))):
                raise ValueError(
                    f"PackedSeqParams.{q} and .{kv} differ; PackedSeqs describes self-attention packs"
                )
        if params.max_seqlen_kv is not None and params.max_seqlen_kv != params.max_seqlen_q:
            raise ValueError(
                f"max_seqlen_q={params.max_seqlen_q} != max_seqlen_kv={params.max_seqlen_kv}; expected equal"
            )
        if total_tokens is None:
            total_tokens = params.total_tokens
        return cls.from_cu_seqlens(
            params.cu_seqlens_q,
            params.cu_seqlens_q_padded,
            total_tokens=total_tokens,
            max_seqlen=params.max_seqlen_q,
        )

    def to_packed_seq_params(self, *, cp_group=None) -> PackedSeqParams:
        """megatron-core ``PackedSeqParams(qkv_format='thd')`` with q == kv (int32 cumulative lengths).

        ``total_tokens`` is set to ``T`` so megatron precomputes ``seq_idx``; ``pad_between_seqs`` is True when any
        document has per-document padding. ``cp_group`` is passed through unchanged.
        """
        require_megatron("thd-packing[megatron]", "PackedSeqs.to_packed_seq_params")
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded,
            cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
            total_tokens=self.total_tokens,
            pad_between_seqs=self.has_padding_between_seqs,
            cp_group=cp_group,
        )

    @property
    def num_seqs(self) -> int:
        """``N``, the number of documents (empty ones included)."""
        return self.cu_seqlens.numel() - 1

    @property
    def num_real_tokens(self) -> int:
        """Rows holding real tokens."""
        return int(self.cu_seqlens[-1])

    @property
    def lengths(self) -> torch.Tensor:
        """``[N]`` int32 real document lengths."""
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def padded_lengths(self) -> torch.Tensor:
        """``[N]`` int32 padded document lengths."""
        return self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]

    @property
    def has_padding_between_seqs(self) -> bool:
        return not torch.equal(self.cu_seqlens, self.cu_seqlens_padded)

    def padding_mask(self) -> torch.Tensor:
        """``[T]`` bool, True on every row that is not a real token (per-document padding and the tail)."""
        rows = torch.arange(self.total_tokens, dtype=torch.int64, device=self.cu_seqlens.device)
        if self.num_seqs == 0:
            return torch.ones_like(rows, dtype=torch.bool)
        doc = self.seq_ids.to(torch.int64).clamp(min=0)
        real_end = self.cu_seqlens_padded.to(torch.int64)[doc] + self.lengths.to(torch.int64)[doc]
        return (self.seq_ids < 0) | (rows >= real_end)

    def to(self, device) -> PackedSeqs:
        """A copy with every tensor on ``device``."""
        return PackedSeqs(
            self.cu_seqlens.to(device),
            self.cu_seqlens_padded.to(device),
            self.max_seqlen,
            self.total_tokens,
            self.position_ids.to(device),
            self.seq_ids.to(device),
        )

    def same_as(self, other: PackedSeqs) -> bool:
        """Exact equality of every field (tensors compared by value)."""
        return (
            self.max_seqlen == other.max_seqlen
            and self.total_tokens == other.total_tokens
            and torch.equal(self.cu_seqlens, other.cu_seqlens)
            and torch.equal(self.cu_seqlens_padded, other.cu_seqlens_padded)
            and torch.equal(self.position_ids, other.position_ids)
            and torch.equal(self.seq_ids, other.seq_ids)
        )
