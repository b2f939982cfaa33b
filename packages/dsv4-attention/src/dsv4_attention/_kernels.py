"""The single import point of csa-kernels ops used by this package.

Everything numeric comes from csa-kernels (API.md contract). While some indexer ops had not landed there yet, this
module carries PRIVATE fp32 stand-ins with the same signature and semantics (``_fallback_*`` below, spec §4.2 and
§5.2); each is used only when csa-kernels does not export the op, and is dropped once it does.
"""

from __future__ import annotations

import itertools

import torch

from csa_kernels import (
    attention_indices,
    compressed_positions,
    compressor_pool,
    sparse_attn,
    visible_compressed_indices,
    window_indices,
)

__all__ = [
    "attention_indices",
    "compressed_positions",
    "compressor_pool",
    "indexer_loss",
    "indexer_scores",
    "indexer_topk",
    "sparse_attn",
    "visible_compressed_indices",
    "window_indices",
]


def _doc_ids(cu: torch.Tensor) -> torch.Tensor:
    cu = cu.to(torch.int64)
    return torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu[1:] - cu[:-1])


def _fallback_indexer_scores(q, k, weights, ratio, cu_seqlens, cu_seqlens_c, *, backend="auto"):
    """``I[t, j] = sum_h w[t,h] relu(<q[t,h], k[cu_c[doc]+j]>)`` ``[T, max_c]`` fp32, ``-inf`` where ``j`` is not
    visible (``j >= floor((t_rel+1)/ratio)``) or past the document's entries. Differentiable."""
    cu = cu_seqlens.to(torch.int64).tolist()
    cuc = cu_seqlens_c.to(torch.int64).tolist()
    max_c = max((b - a for a, b in itertools.pairwise(cuc)), default=0)
    out = torch.full((q.shape[0], max_c), float("-inf"), device=q.device, dtype=torch.float32)
    qf, kf, wf = q.float(), k.float(), weights.float()
    parts = []
    for i in range(len(cu) - 1):
        t0, t1, c0, c1 = cu[i], cu[i + 1], cuc[i], cuc[i + 1]
        if t1 == t0:
            continue
        n = c1 - c0
        s = torch.relu(torch.einsum("thd,sd->ths", qf[t0:t1], kf[c0:c1]))  # [L, H, n]
        s = (s * wf[t0:t1, :, None]).sum(1)  # [L, n]
        t_rel = torch.arange(t1 - t0, device=q.device)
        vis = torch.arange(n, device=q.device)[None, :] < ((t_rel + 1) // ratio)[:, None]
        s = torch.where(vis, s, float("-inf"))
        parts.append((t0, t1, torch.nn.functional.pad(s, (0, max_c - n), value=float("-inf"))))
    if not parts:
        return out + 0 * (qf.sum() + kf.sum() + wf.sum())
    rows = [p[2] for p in parts]
    idx = torch.cat([torch.arange(a, b, device=q.device) for a, b, _ in parts])
    return out.index_put((idx,), torch.cat(rows))


def _fallback_indexer_topk(
    q, k, weights, ratio, topk, cu_seqlens, cu_seqlens_c, *, backend="auto", chunk_size=None
):
    """Top-``k_eff`` visible entries per query (ties toward the lower entry index), as global compressed rows
    ``[T, topk]`` int32 (``-1`` padded) and their scores ``[T, topk]`` fp32 (``-inf`` padded)."""
    with torch.no_grad():
        s = _fallback_indexer_scores(q, k, weights, ratio, cu_seqlens, cu_seqlens_c)  # [T, max_c]
        t, max_c = s.shape
        kk = min(topk, max_c)
        vals, loc = torch.sort(s, dim=1, descending=True, stable=True)
        vals, loc = vals[:, :kk], loc[:, :kk]
        first = cu_seqlens_c.to(torch.int64)[_doc_ids(cu_seqlens)]  # [T]
        rows = torch.where(torch.isfinite(vals), loc + first[:, None], -1)
        idx = torch.full((t, topk), -1, dtype=torch.int32, device=q.device)
        sc = torch.full((t, topk), float("-inf"), dtype=torch.float32, device=q.device)
        idx[:, :kk] = rows.to(torch.int32)
        sc[:, :kk] = vals
    return idx, sc


def _fallback_indexer_loss(
    q, kv_all, attn_sink, lse, comp_indices, index_scores, softmax_scale, *, backend="auto"
):
    """KL(teacher || softmax(index_scores)) per row over the valid entries of ``comp_indices`` (rows of ``kv_all``).

    ``log pi[t,h,s] = <q[t,h], kv_all[idx[t,s]]> * scale - lse[t,h]`` (lse includes window, compressed and sink);
    ``log p[t,s] = logsumexp_h log pi`` L1-normalised over valid ``s`` (log domain, no underflow); student
    ``log_softmax(index_scores)`` over valid ``s``. Returns ``(mean over rows with entries, per_row_kl [T])``;
    gradient flows only into ``index_scores``.
    """
    valid = comp_indices >= 0  # [T, K]
    with torch.no_grad():
        rows = kv_all.float()[comp_indices.clamp(min=0).long()]  # [T, K, D]
        z = (
            torch.einsum("thd,tkd->thk", q.float(), rows) * softmax_scale - lse.float()[..., None]
        )  # [T, H, K]
        log_p = torch.logsumexp(z, dim=1)  # [T, K]
        log_p = log_p.masked_fill(~valid, float("-inf"))
        log_p = log_p - torch.logsumexp(log_p, dim=1, keepdim=True)
        p = log_p.exp().nan_to_num(0.0)
    has = valid.any(1)
    s = index_scores.float().masked_fill(~valid, float("-inf"))
    s = torch.where(has[:, None], s, torch.zeros_like(s))  # keep rows without entries finite (no NaN grads)
    log_q = s - torch.logsumexp(s, dim=1, keepdim=True)
    terms = torch.where(p > 0, p * (log_p.nan_to_num(0.0) - log_q), torch.zeros_like(p))
    per_row = torch.where(has, terms.sum(1), torch.zeros(valid.shape[0], device=s.device))
    loss = per_row.sum() / has.sum().clamp(min=1)
    return loss, per_row


try:
    from csa_kernels import indexer_scores
except ImportError:
    indexer_scores = _fallback_indexer_scores
try:
    from csa_kernels import indexer_topk
except ImportError:
    indexer_topk = _fallback_indexer_topk
try:
    from csa_kernels import indexer_loss
except ImportError:
    indexer_loss = _fallback_indexer_loss
