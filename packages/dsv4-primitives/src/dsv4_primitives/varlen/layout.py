"""Packed (THD, flash-attn varlen) layout conversions: lengths <-> ``cu_seqlens`` <-> document ids / positions,
compressed ``cu_seqlens`` of a ratio, and the SBHD <-> THD views.

Convention: ``cu_seqlens`` int32 ``[N+1]`` (empty documents allowed); document ``i`` owns packed rows
``cu_seqlens[i] .. cu_seqlens[i+1]-1`` and positions restart at 0 in every document. Compression by ``ratio``
works per document: document ``i`` yields ``floor(len_i / ratio)`` entries, stored contiguously in
``cu_seqlens_c`` order.

Shape legend: ``N`` documents, ``T`` packed rows, ``S`` sequence length, ``B`` batch.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Sequence

import torch

from dsv4_primitives.varlen.checks import (
    check_cu_seqlens,
    check_cu_values,
    check_host_cu_seqlens,
    check_ratio,
)


def cu_seqlens_from_lengths(lengths: Sequence[int] | torch.Tensor, device=None) -> torch.Tensor:
    """int32 ``[N+1]`` prefix sums ``[0, l0, l0+l1, ...]`` of document lengths (zeros allowed: empty documents).

    ``lengths``: Python / NumPy ints, or an integer tensor (computed on its device unless ``device`` is given).
    """
    if isinstance(lengths, torch.Tensor):
        if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
            raise ValueError(f"lengths must be an integer tensor, got dtype {lengths.dtype}")
        lens = lengths.reshape(-1).to(dtype=torch.int64, device=device)
    else:
        values = list(lengths)
        if any(not isinstance(n, numbers.Integral) or isinstance(n, bool) for n in values):
            raise ValueError(f"lengths must be ints >= 0, got {values}")
        lens = torch.tensor([int(n) for n in values], dtype=torch.int64)
    if lens.numel() and bool((lens < 0).any()):
        raise ValueError(f"lengths must be ints >= 0, got {lens.tolist()}")
    out = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=lens.device)
    torch.cumsum(lens, 0, out=out[1:])
    return out.to(dtype=torch.int32, device=device if device is not None else lens.device)


def lengths_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[N]`` document lengths ``cu_seqlens[i+1] - cu_seqlens[i]`` (dtype of ``cu_seqlens``)."""
    return cu_seqlens[1:] - cu_seqlens[:-1]


def document_ids(
    cu_seqlens: torch.Tensor, total: int | None = None, *, tail: int | None = None
) -> torch.Tensor:
    """``[T]`` int64 document index of every packed row.

    ``total``: ``T`` when known on the host (then no device -> host sync), else ``cu_seqlens[-1]`` (read back).
    Rows at or past ``cu_seqlens[-1]`` (a static-shape tail) get index ``N`` (one past the last document), or
    ``tail`` when given (e.g. ``-1``).
    """
    cu = cu_seqlens.to(torch.int64)
    total = int(cu[-1]) if total is None else int(total)
    rows = torch.arange(total, device=cu.device, dtype=torch.int64)  # [T]
    doc = torch.searchsorted(cu[1:], rows, right=True)  # [T]
    if tail is not None:
        doc = torch.where(rows < cu[-1], doc, torch.full_like(doc, tail))
    return doc


def document_positions(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """``[T]`` int64 document-relative position of every packed row (``total`` as in :func:`document_ids`).

    Rows past ``cu_seqlens[-1]`` (static-shape padding up to ``total``) continue counting from the start of the
    last document.
    """
    cu = cu_seqlens.to(torch.int64)
    total = int(cu[-1]) if total is None else int(total)
    rows = torch.arange(total, device=cu.device, dtype=torch.int64)  # [T]
    if cu.numel() == 1:
        return rows
    doc = torch.searchsorted(cu[1:], rows, right=True).clamp_(max=cu.numel() - 2)  # [T]
    return rows - cu[doc]


def compressed_cu_seqlens(
    cu_seqlens: torch.Tensor, ratio: int, *, cu_seqlens_host: Sequence[int] | None = None
) -> torch.Tensor:
    """``cu_seqlens_c`` int32 ``[N+1]`` with ``cu_seqlens_c[i+1] - cu_seqlens_c[i] = floor(len_i / ratio)``.

    ``cu_seqlens_host``: the caller's host copy of ``cu_seqlens`` (validation without a device sync).
    """
    check_ratio(ratio)
    check_cu_seqlens(cu_seqlens, host=cu_seqlens_host)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64) // ratio
    out = torch.zeros(cu_seqlens.numel(), dtype=torch.int32, device=cu_seqlens.device)
    out[1:] = torch.cumsum(lens, 0).to(torch.int32)
    return out


def compressed_cu_seqlens_host(cu_seqlens_host: Sequence[int], ratio: int) -> list[int]:
    """Host form of :func:`compressed_cu_seqlens`: ``cu_seqlens_c`` as a list from the host list ``cu_seqlens``
    (pure Python, no tensor; the host copy of ``SeqBoundaries.compressed(ratio)``)."""
    check_ratio(ratio)
    cu = check_cu_values(check_host_cu_seqlens(cu_seqlens_host), "cu_seqlens_host", None)
    out = [0]
    for a, b in itertools.pairwise(cu):
        out.append(out[-1] + (b - a) // ratio)
    return out


def sbhd_cu_seqlens(batch: int, seq_len: int, device=None) -> torch.Tensor:
    """``[0, S, 2S, ..., B*S]`` int32: the THD view of an SBHD batch of ``B`` sequences of length ``S``."""
    if batch < 0 or seq_len < 0:
        raise ValueError(f"batch and seq_len must be >= 0, got {batch}, {seq_len}")
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * seq_len


def sbhd_cu_seqlens_host(batch: int, seq_len: int) -> list[int]:
    """Host list ``[0, S, 2S, ..., B*S]`` (the host copy of :func:`sbhd_cu_seqlens`)."""
    if batch < 0 or seq_len < 0:
        raise ValueError(f"batch and seq_len must be >= 0, got {batch}, {seq_len}")
    return [b * seq_len for b in range(batch + 1)]


def sbhd_to_thd(x: torch.Tensor) -> torch.Tensor:
    """``[S, B, ...] -> [B*S, ...]`` with each sequence's rows contiguous (document ``b`` = rows ``b*S .. b*S+S-1``)."""
    return x.transpose(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def thd_to_sbhd(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of :func:`sbhd_to_thd`: ``[B*S, ...] -> [S, B, ...]``."""
    return x.reshape(batch, x.shape[0] // max(batch, 1), *x.shape[1:]).transpose(0, 1)
