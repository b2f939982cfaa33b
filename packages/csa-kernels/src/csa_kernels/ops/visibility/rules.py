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

Complexity: O(T * (W + max_entries)) int32 output, no other intermediate of that size except the output itself.
"""

from __future__ import annotations

import itertools

import torch

from csa_kernels._checks import check_cu_seqlens, check_ratio
from dsv4_primitives.varlen import compressed_cu_seqlens_host, document_ids, upload_host_ints


def window_indices(
    cu_seqlens: torch.Tensor, window: int, *, cu_seqlens_host: list[int] | None = None
) -> torch.Tensor:
    """``[T, W]`` int32 global rows ``t - W + 1 .. t`` of the query's document, ``-1`` before the document start.

    ``cu_seqlens_host``: the caller's host copy of ``cu_seqlens``; with it the call does no device -> host sync.
    """
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    cu_l = check_cu_seqlens(cu_seqlens, host=cu_seqlens_host)
    cu = cu_seqlens.to(torch.int64)
    return window_rows(cu, document_ids(cu, cu_l[-1]), window)


def window_rows(cu: torch.Tensor, doc: torch.Tensor, window: int) -> torch.Tensor:
    """The math of :func:`window_indices` from int64 ``cu [N+1]`` and the rows' documents ``doc [T]`` (device
    only; shared by the host-bounds and the static-bounds forms)."""
    t = torch.arange(doc.numel(), device=cu.device)
    rows = t[:, None] - window + 1 + torch.arange(window, device=cu.device)  # [T, W]
    rows = torch.where(rows >= cu[doc][:, None], rows, -1)
    return rows.to(torch.int32)


def visible_compressed_indices(
    cu_seqlens: torch.Tensor,
    cu_seqlens_c: torch.Tensor,
    ratio: int,
    max_entries: int | None = None,
    *,
    cu_seqlens_host: list[int] | None = None,
    cu_seqlens_c_host: list[int] | None = None,
) -> torch.Tensor:
    """``[T, max_entries]`` int32: every visible entry ``w < floor((t_rel + 1) / ratio)`` as a global compressed row.

    ``max_entries`` defaults to the largest document's entry count; a smaller value that would drop visible
    entries raises ValueError. ``cu_seqlens_host`` / ``cu_seqlens_c_host``: the caller's host copies (validated
    against each other in Python); with both the call does no device -> host sync.
    """
    check_ratio(ratio)
    cu_l = check_cu_seqlens(cu_seqlens, host=cu_seqlens_host)
    cuc_l = check_cu_seqlens(cu_seqlens_c, "cu_seqlens_c", host=cu_seqlens_c_host)
    expected = compressed_cu_seqlens_host(cu_l, ratio)
    if cuc_l != expected:
        raise ValueError(
            f"cu_seqlens_c = {cuc_l} does not match floor(len / ratio) per document ({expected})"
        )
    need = max((b - a for a, b in itertools.pairwise(cuc_l)), default=0)
    if max_entries is None:
        max_entries = need
    if not isinstance(max_entries, int) or max_entries < need:
        raise ValueError(
            f"max_entries must be an int >= the largest document's entry count {need}, got {max_entries!r}"
        )
    cu = cu_seqlens.to(torch.int64)
    return visible_rows(cu, cu_seqlens_c, document_ids(cu, cu_l[-1]), ratio, max_entries)


def visible_rows(
    cu: torch.Tensor, cu_c: torch.Tensor, doc: torch.Tensor, ratio: int, max_entries: int
) -> torch.Tensor:
    """The math of :func:`visible_compressed_indices` from int64 ``cu [N+1]``, ``cu_c [N+1]`` and the rows'
    documents ``doc [T]`` (device only; shared by the host-bounds and the static-bounds forms)."""
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


def csa_dense_mask(
    cu_seqlens: torch.Tensor, cu_seqlens_c: torch.Tensor, ratio: int, window: int
) -> torch.Tensor:
    """``[T, T + Tc]`` bool: the dense-mode candidate set (window rows, then visible compressed rows), built
    directly from the rules (independent of the index builders; oracle A1 / M1 / M3)."""
    cu = cu_seqlens.to(torch.int64)
    cuc = cu_seqlens_c.to(torch.int64)
    doc_q = document_ids(cu)  # [T]
    t = torch.arange(doc_q.numel(), device=cu.device)
    win = (doc_q[:, None] == doc_q[None, :]) & (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)
    doc_c = document_ids(cuc)  # [Tc]
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
    cu = upload_host_ints([0, seq_len], device)
    return window_indices(cu, window, cu_seqlens_host=[0, seq_len])


def visible_compressed_indices_sbhd(seq_len: int, ratio: int, device=None) -> torch.Tensor:
    """SBHD form: ``[S, S // ratio]`` int32 LOCAL entry ids ``w < floor((t+1)/ratio)``, ``-1`` after."""
    if not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len must be an int >= 0, got {seq_len!r}")
    check_ratio(ratio)
    cu_l, cuc_l = [0, seq_len], [0, seq_len // ratio]
    return visible_compressed_indices(
        upload_host_ints(cu_l, device),
        upload_host_ints(cuc_l, device),
        ratio,
        cu_seqlens_host=cu_l,
        cu_seqlens_c_host=cuc_l,
    )
