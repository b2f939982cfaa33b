"""fp32 reference of the lightning indexer and its top-k (dsv4-architecture.md §4.2, oracles I1, I2, I4, I6).

Per query row ``t`` (document-relative position ``t_rel``) and compressed entry ``s`` of the SAME document:

    I[t, s] = sum_h weights[t, h] * ReLU( <q_idx[t, h], k_idx[s]> )      (no softmax; may be negative)
    I[t, s] = -inf   unless s is visible: (s_local + 1) * ratio <= t_rel + 1
    sel(t)  = the min(topk, visible(t)) highest visible scores, in descending order, ties -> lower entry index first;
              the remaining slots of the [topk] row are -1 (score -inf)

``weights`` already carries the scale ``DI^-1/2 * HI^-1/2`` (a positive scale never changes the top-k; it matters
only for the indexer loss). Top-k is not differentiable; the returned scores are, in ``q_idx``, ``k_idx`` and
``weights`` (the indexer loss trains the indexer through them).

dtype policy: math in fp32 (fp64 when any input is fp64); scores returned in the compute dtype.
Complexity: ``O(T * HI * DI * C_doc / 2)`` flops (causal prefix only). Memory: documents are processed one at a
time and each in chunks of ``n`` query rows; the largest intermediates are ``[n, HI, C_doc]`` (dots and ReLU) and
``[n, C_doc]`` (scores, sort), with ``n = chunk_size`` or ``max(1, 2^24 // (HI * C_doc))``. ``[T, HI, C]`` is never
formed, in forward or backward (backward recomputes one chunk at a time).
"""

from __future__ import annotations

import torch

from csa_kernels._checks import (
    check_topk,
    compute_dtype,
)
from csa_kernels._chunking import map_row_chunks, rows_per_chunk
from csa_kernels.ops.indexer.checks import check_inputs as _check_inputs
from csa_kernels.ops.indexer.checks import check_scores_at_inputs as _check_scores_at_inputs
from csa_kernels.ops.indexer.checks import check_scores_inputs as _check_scores_inputs
from dsv4_primitives.varlen import SeqBoundaries


def _chunk_scores(q, w, t_rel, k_doc, ratio):
    """``q [n, H, DI]``, ``w [n, H]``, ``t_rel [n]``, ``k_doc [C, DI]`` -> masked scores ``[n, C]``."""
    dots = torch.einsum("nhd,cd->nhc", q, k_doc)  # [n, H, C]
    scores = torch.einsum("nhc,nh->nc", torch.relu(dots), w)  # [n, C]
    visible = torch.arange(k_doc.shape[0], device=q.device)[None, :] < ((t_rel + 1) // ratio)[:, None]
    return scores.masked_fill(~visible, float("-inf"))


def _document_chunks(cu, cuc, ratio, heads, chunk_size):
    """Yield ``(doc, row_start, row_end, entry_start, n_entries, rows_per_chunk)`` for documents with rows."""
    for i in range(len(cu) - 1):
        if cu[i + 1] > cu[i]:
            n_c = cuc[i + 1] - cuc[i]
            yield i, cu[i], cu[i + 1], cuc[i], n_c, rows_per_chunk(heads * max(n_c, 1), chunk_size)


def indexer_scores_ref(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    ratio: int,
    bounds: SeqBoundaries,
    max_entries: int | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Dense index scores ``[T, max_entries]``: column ``j`` = LOCAL entry ``j`` of the row's own document (global
    compressed row ``cu_seqlens_c[doc] + j`` of ``bounds.compressed(ratio)``, the same slots as
    ``visible_compressed_indices``); ``-inf`` where invisible or past the document's entries.

    Args:
        q_idx: ``[T, HI, DI]`` indexer queries (RoPE applied). k_idx: ``[Tc, DI]`` indexer compressed keys.
        weights: ``[T, HI]`` per-head weights (scale included). ratio: compression ratio (4).
        bounds: the documents of the ``T`` rows (host boundaries: no device -> host sync; static ones are read
            back, one sync, and ``k_idx`` holds the entry capacity ``T // ratio``).
        max_entries: output width (default ``bounds.max_entries(ratio)``: the largest document's entry count, or
            the capacity; must not be smaller).
        chunk_size: query rows per chunk (default: automatic, see module docstring).
    """
    max_entries = _check_scores_inputs(q_idx, k_idx, weights, ratio, bounds, max_entries)
    cu, cuc = _host_lists(bounds, ratio)
    dt = compute_dtype(q_idx, k_idx, weights)
    q, k, w = q_idx.to(dt), k_idx.to(dt), weights.to(dt)
    t_all = torch.arange(q.shape[0], device=q.device)
    parts = []
    for _, r0, r1, c0, n_c, chunk in _document_chunks(cu, cuc, ratio, q.shape[1], chunk_size):

        def fn(q_c, w_c, t_c, k_doc):
            s = _chunk_scores(q_c, w_c, t_c, k_doc, ratio)  # [n, C_doc]
            return torch.nn.functional.pad(s, (0, max_entries - k_doc.shape[0]), value=float("-inf"))

        parts.append(map_row_chunks(fn, [q[r0:r1], w[r0:r1], t_all[r0:r1] - r0], [k[c0 : c0 + n_c]], chunk))
    if not parts:
        return q.new_zeros(0, max_entries) + 0 * (q.sum() + k.sum() + w.sum())
    return torch.cat(parts)


def _host_lists(bounds: SeqBoundaries, ratio: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Host ``(cu_seqlens, cu_seqlens_c)`` of the document loops (static boundaries read back: one sync)."""
    exact = bounds.exact()
    return exact.host, exact.compressed(ratio).host


def indexer_scores_at_ref(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    chunk_size: int | None = None,
    *,
    check_indices: bool = True,
) -> torch.Tensor:
    """Index scores at given entries: ``[T, K]`` with ``I[t, indices[t, k]]`` (``-inf`` where ``indices = -1``).

    ``indices [T, K]`` are global rows of ``k_idx`` (as returned by :func:`indexer_topk_ref`); visibility is NOT
    re-checked. Differentiable in ``q_idx``, ``k_idx``, ``weights`` (the student logits of the sparse indexer loss)::

        S[t, j, h]  = <q_idx[t, h], k_idx[indices[t, j]]>
        I[t, j]     = sum_h weights[t, h] * relu(S[t, j, h])             (-inf where indices[t, j] = -1)
        dS[t, j, h] = g[t, j] * weights[t, h] * [S > 0]                  (g = dL/dI, 0 where indices = -1)
        d weights[t, h] = sum_j g[t, j] relu(S[t, j, h]);  d q_idx[t, h] = sum_j dS[t, j, h] k_idx[indices[t, j]]
        d k_idx[e]  = sum over (t, j) with indices[t, j] = e of sum_h dS[t, j, h] q_idx[t, h]

    Memory: chunks of ``n = chunk_size`` or ``2^24 // (K * max(HI, DI))`` rows (gathered ``[n, K, DI]`` rows and
    ``[n, HI, K]`` dots), recomputed one chunk at a time in backward.

    ``check_indices=False`` skips the range check of ``indices`` (a device -> host sync); the caller guarantees
    ``-1 <= indices < Tc``, out-of-range values are undefined behaviour.
    """
    _check_scores_at_inputs(q_idx, k_idx, weights, indices, check_indices)
    h, d = q_idx.shape[1:]
    dt = compute_dtype(q_idx, k_idx, weights)
    chunk = rows_per_chunk(indices.shape[1] * max(h, d), chunk_size)
    return map_row_chunks(_scores_at_chunk, [q_idx.to(dt), weights.to(dt), indices], [k_idx.to(dt)], chunk)


def _scores_at_chunk(q, w, idx, k):
    valid = idx >= 0  # [n, K]
    if k.shape[0] == 0:  # empty compressed buffer (Tc = 0): every index is -1; gather from one zero row
        k = torch.cat((k, k.new_zeros(1, k.shape[1])))
    # index_select, not k[idx]: its backward is an index_add (atomics), while advanced indexing's backward is a
    # deterministic sorted index_put that serialises the many repeats of popular entries (730 ms vs ~5 ms per
    # flash-smoke step on the H200: every entry is selected by hundreds of rows)
    rows = k.index_select(0, idx.clamp(min=0).reshape(-1).long()).view(*idx.shape, k.shape[1])  # [n, K, DI]
    dots = torch.einsum("nhd,nkd->nhk", q, rows)  # [n, H, K]
    scores = torch.einsum("nhk,nh->nk", torch.relu(dots), w)  # [n, K]
    return scores.masked_fill(~valid, float("-inf"))


TIE_BREAKS = ("lower_index", "torch_topk")


def _select(
    scores: torch.Tensor, topk: int, tie_break: str = "lower_index"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``scores [n, C]`` by value; ``-inf`` is never selected (-> -1, trailing slots).

    ``lower_index``: ties -> lower column first (stable descending sort). ``torch_topk``: whatever ``torch.topk`` on
    this device does with the given row (for parity with HF logits computed on CPU, spec §4.2 rule 1).
    """
    if tie_break == "torch_topk":
        vals, cols = torch.topk(scores, min(topk, scores.shape[1]), dim=1, sorted=True)
    else:
        vals, cols = torch.sort(scores, dim=1, descending=True, stable=True)
        vals, cols = vals[:, :topk], cols[:, :topk]
    cols = torch.where(torch.isneginf(vals), -1, cols)
    pad = topk - cols.shape[1]
    if pad > 0:
        cols = torch.nn.functional.pad(cols, (0, pad), value=-1)
        vals = torch.nn.functional.pad(vals, (0, pad), value=float("-inf"))
    return cols, vals


def indexer_topk_ref(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    ratio: int,
    topk: int,
    bounds: SeqBoundaries,
    chunk_size: int | None = None,
    tie_break: str = "lower_index",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked scores + top-k (module docstring).

    ``tie_break="lower_index"`` (default, spec §4.2 rule 2, oracle I6) orders equal scores by entry index.
    ``tie_break="torch_topk"`` reproduces the official code / HF instead: ``torch.topk`` over the document's FULL
    masked row (all its entries, ``-inf`` where invisible), whose tie order on CPU depends on the whole row; use it
    only for parity with logits HF computed on CPU (spec §4.2 rule 1).

    ``bounds``: the documents of the ``T`` rows (host boundaries: no device -> host sync for the validation and the
    document loop; static ones are read back, one sync, and ``k_idx`` holds the entry capacity ``T // ratio``).

    Returns:
        ``indices [T, topk]`` int32 global rows of the compressed buffer (``k_idx`` / ``entries``), descending
        score, ties toward the lower entry, ``-1`` in the trailing slots when fewer than ``topk`` are visible;
        ``scores [T, topk]`` (compute dtype, ``-inf`` at ``-1``), differentiable in ``q_idx``, ``k_idx``, ``weights``.
    """
    _check_inputs(q_idx, k_idx, weights, ratio, bounds)
    cu, cuc = _host_lists(bounds, ratio)
    check_topk(topk)
    if tie_break not in TIE_BREAKS:
        raise ValueError(f"tie_break must be one of {TIE_BREAKS}, got {tie_break!r}")
    dt = compute_dtype(q_idx, k_idx, weights)
    t = q_idx.shape[0]
    indices = torch.full((t, topk), -1, dtype=torch.int32, device=q_idx.device)
    values = torch.full((t, topk), float("-inf"), dtype=dt, device=q_idx.device)
    with torch.no_grad():
        q, k, w = q_idx.to(dt), k_idx.to(dt), weights.to(dt)
        for _, r0, r1, c0, n_c, chunk in _document_chunks(cu, cuc, ratio, q.shape[1], chunk_size):
            if n_c == 0:
                continue
            for s in range(r0, r1, chunk):
                e = min(s + chunk, r1)
                t_rel = torch.arange(s - r0, e - r0, device=q.device)
                # the visible entries of the chunk's last row (a causal prefix) suffice, except for torch_topk,
                # whose CPU tie order depends on the whole masked row
                n_row = n_c if tie_break == "torch_topk" else (e - r0) // ratio
                scores = _chunk_scores(q[s:e], w[s:e], t_rel, k[c0 : c0 + n_row], ratio)  # [n, n_row]
                cols, vals = _select(scores, topk, tie_break)
                indices[s:e] = torch.where(cols >= 0, cols + c0, -1).to(torch.int32)
                values[s:e] = vals
    if not torch.is_grad_enabled() or not any(x.requires_grad for x in (q_idx, k_idx, weights)):
        return indices, values
    # differentiable scores at the selected entries; the forward value stays the selection pass's value exactly
    live = indexer_scores_at_ref(q_idx, k_idx, weights, indices, chunk_size, check_indices=False)
    live = torch.where(indices >= 0, live, 0.0)
    return indices, values + (live - live.detach())
