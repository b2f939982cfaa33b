"""Visibility rules and candidate-index builders (pure index math: one implementation, no backend switch) (dsv4-architecture.md §2.2, §3.4, §3.5).

All rules are per document (document-relative position ``t``; nothing crosses a document boundary):

* window (M3): query ``t`` sees raw rows ``s`` with ``t - W + 1 <= s <= t`` and ``s >= 0``;
* compressed (M1): query ``t`` sees entry ``w`` of its own document iff ``(w + 1) * ratio <= t + 1``, i.e.
  ``w < floor((t + 1) / ratio)``.

Index tensors hold GLOBAL packed row ids (int32), ``-1`` = empty slot:

* ``window_indices [T, W]``: slot ``j`` holds row ``t - W + 1 + j`` (the last slot is ``t`` itself), ``-1`` where that
  row lies before the document start;
* ``visible_compressed_indices [T, max_entries]``: slot ``j`` holds compressed row ``cu_seqlens_c[doc] + j`` for the
  visible ``j``, ``-1`` after (dense mode / HCA);
* ``attention_indices``: ``[window | compressed + T]`` rows into ``kv_all = cat([kv [T, D], entries [Tc, D]])``.

Every builder takes the documents as one :class:`~dsv4_primitives.varlen.SeqBoundaries` and computes on the device
from it (no device -> host sync, host or static boundaries alike: capturable in a CUDA graph); the result is
memoised on the boundaries (every layer of a step shares it). Static boundaries give capacity widths
(``visible_compressed_indices``: ``T // ratio`` columns, ``-1`` past each row's visible entries).

Complexity: O(T * (W + max_entries)) int32 output, no other intermediate of that size except the output itself.
"""

from __future__ import annotations

import torch

from csa_kernels._checks import check_bounds, check_ratio
from dsv4_primitives.varlen import SeqBoundaries, document_ids


def window_indices(bounds: SeqBoundaries, window: int) -> torch.Tensor:
    """``[T, W]`` int32 global rows ``t - W + 1 .. t`` of the query's document, ``-1`` before the document start."""
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    check_bounds(bounds)
    return bounds.derived(("window_indices", window), lambda: _window_rows(bounds, window))


def _window_rows(bounds: SeqBoundaries, window: int) -> torch.Tensor:
    """The math of :func:`window_indices` (device only)."""
    cu, doc = bounds.cu64, bounds.document_ids()  # [N+1], [T]
    t = torch.arange(doc.numel(), device=cu.device)
    rows = t[:, None] - window + 1 + torch.arange(window, device=cu.device)  # [T, W]
    rows = torch.where(rows >= cu[doc][:, None], rows, -1)
    return rows.to(torch.int32)


def visible_compressed_indices(
    bounds: SeqBoundaries, ratio: int, max_entries: int | None = None
) -> torch.Tensor:
    """``[T, max_entries]`` int32: every visible entry ``w < floor((t_rel + 1) / ratio)`` as a global compressed row
    (rows of ``bounds.compressed(ratio)``), ``-1`` after.

    ``max_entries`` defaults to ``bounds.max_entries(ratio)`` (the largest document's entry count; static
    boundaries: the capacity ``T // ratio``); a smaller value, which could drop visible entries, raises ValueError.
    """
    check_ratio(ratio)
    need = check_bounds(bounds).max_entries(ratio)
    if max_entries is None:
        max_entries = need
    if not isinstance(max_entries, int) or max_entries < need:
        what = "the entry capacity T // ratio" if bounds.is_static else "the largest document's entry count"
        raise ValueError(f"max_entries must be an int >= {what} {need}, got {max_entries!r}")
    return bounds.derived(
        ("visible_compressed_indices", ratio, max_entries), lambda: _visible_rows(bounds, ratio, max_entries)
    )


def _visible_rows(bounds: SeqBoundaries, ratio: int, max_entries: int) -> torch.Tensor:
    """The math of :func:`visible_compressed_indices` (device only)."""
    cu, cu_c, doc = bounds.cu64, bounds.compressed(ratio).cu_seqlens, bounds.document_ids()
    t_rel = torch.arange(doc.numel(), device=cu.device) - cu[doc]
    n_vis = (t_rel + 1) // ratio  # [T]
    j = torch.arange(max_entries, device=cu.device)
    rows = cu_c.to(torch.int64)[doc][:, None] + j  # [T, max_entries]
    rows = torch.where(j < n_vis[:, None], rows, -1)
    return rows.to(torch.int32)


def _broadcast_lead(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    # plain-Python broadcasting (torch.broadcast_shapes imports the symbolic-shape stack: seconds on first use)
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    if any(x != y and 1 not in (x, y) for x, y in zip(a, b)):
        raise ValueError(f"window_idx and comp_idx leading dims do not broadcast: {a} vs {b}")
    return tuple(max(x, y) if 1 in (x, y) else x for x, y in zip(a, b))


def attention_indices(window_idx: torch.Tensor, comp_idx: torch.Tensor, offset: int) -> torch.Tensor:
    """``[..., W + Kc]`` = ``[window_idx | comp_idx + offset]`` keeping ``-1`` (leading dims broadcast).

    ``offset`` = number of raw rows in front of the compressed rows in ``kv_all`` (``T`` for THD, ``S`` for SBHD).
    """
    lead = _broadcast_lead(tuple(window_idx.shape[:-1]), tuple(comp_idx.shape[:-1]))
    w = window_idx.to(torch.int32).expand(*lead, window_idx.shape[-1])
    c = comp_idx.to(torch.int64)
    c = torch.where(c >= 0, c + offset, -1).to(torch.int32).expand(*lead, comp_idx.shape[-1])
    return torch.cat((w, c), -1)


def csa_dense_mask(bounds: SeqBoundaries, ratio: int, window: int) -> torch.Tensor:
    """``[T, T + Tc]`` bool: the dense-mode candidate set (window rows, then visible compressed rows), built
    directly from the rules (independent of the index builders; oracle A1 / M1 / M3)."""
    bounds_c = check_bounds(bounds).compressed(ratio)
    cu = bounds.cu_seqlens.to(torch.int64)
    cuc = bounds_c.cu_seqlens.to(torch.int64)
    doc_q = document_ids(cu, bounds.total)  # [T]
    t = torch.arange(doc_q.numel(), device=cu.device)
    win = (doc_q[:, None] == doc_q[None, :]) & (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)
    doc_c = document_ids(cuc, bounds_c.total)  # [Tc]
    w_rel = torch.arange(doc_c.numel(), device=cu.device) - cuc[doc_c]  # [Tc]
    t_rel = t - cu[doc_q]
    comp = (doc_q[:, None] == doc_c[None, :]) & ((w_rel[None, :] + 1) * ratio <= t_rel[:, None] + 1)
    return torch.cat((win, comp), 1)


def indices_to_mask(indices: torch.Tensor, n_kv: int) -> torch.Tensor:
    """``[T, n_kv]`` int64 multiplicity of each kv row in ``indices [T, K]`` (``-1`` ignored)."""
    idx = indices.to(torch.int64)
    valid = idx >= 0
    counts = torch.zeros(idx.shape[0], n_kv + 1, dtype=torch.int64, device=idx.device)
    counts.scatter_add_(1, torch.where(valid, idx, n_kv), valid.to(torch.int64))
    return counts[:, :n_kv]


def window_indices_sbhd(seq_len: int, window: int, device=None) -> torch.Tensor:
    """SBHD form: ``[S, W]`` int32 LOCAL rows ``t - W + 1 .. t`` (``-1`` below 0), the same for every sequence."""
    if not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len must be an int >= 0, got {seq_len!r}")
    return window_indices(SeqBoundaries.from_host([0, seq_len], device), window)


def visible_compressed_indices_sbhd(seq_len: int, ratio: int, device=None) -> torch.Tensor:
    """SBHD form: ``[S, S // ratio]`` int32 LOCAL entry ids ``w < floor((t+1)/ratio)``, ``-1`` after."""
    if not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len must be an int >= 0, got {seq_len!r}")
    check_ratio(ratio)
    return visible_compressed_indices(SeqBoundaries.from_host([0, seq_len], device), ratio)
