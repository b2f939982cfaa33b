"""fp32 reference of the indexer KL loss with the full-denominator teacher (dsv4-architecture.md §5.2, oracle I5).

For each query row ``t`` and each valid slot ``s`` of ``comp_indices[t]`` (a row of ``kv_all``; ``-1`` = none):

    z[h,t,s]    = softmax_scale * <q[t,h], kv_all[comp_indices[t,s]]>          (main attention logits)
    log pi      = z[h,t,s] - lse[t,h]                                            (lse = FULL denominator: window +
                                                                                   compressed + sink, from sparse_attn)
    log p[t,s]  = logsumexp_h(log pi[h,t,s]) - logsumexp_{s', h}(log pi[h,t,s'])  (sum heads, L1-normalise, log domain)
    log r[t,s]  = log_softmax_s(index_scores[t, s])                              (student, over the same valid slots)
    KL[t]       = sum_s p[t,s] * (log p[t,s] - log r[t,s])                       (0 for rows without a valid slot)
    loss        = mean of KL[t] over rows with at least one valid slot           (0 if there is none)

The teacher (``q``, ``kv_all``, ``lse``) is detached: the gradient reaches only ``index_scores`` and through it the
indexer parameters (oracle I3); ``d loss / d index_scores[t] = (r[t] - p[t]) / n_rows``. Working in the log domain
keeps rows whose compressed mass underflows fp32 (``exp(z - lse) == 0`` for every slot) well defined.
Dense phase: ``comp_indices`` = all visible entries (``visible_compressed_indices + T``) with ``index_scores`` =
``indexer_scores``; sparse phase: the top-k rows (``indexer_topk`` indices ``+ T``) with their scores.

dtype policy: fp32 math (fp64 when any input is fp64); loss and per-row KL in the compute dtype.
Complexity: ``O(T * Kc * H * D)``. Memory: the teacher is built in chunks of ``n`` rows (largest intermediates
``[n, Kc, D]`` gathered rows and ``[n, H, Kc]`` logits, ``n = chunk_size`` or ``2^24 // (Kc * max(D, H))``); the
rest is ``O(T * Kc)``.
"""

from __future__ import annotations

import torch

from csa_kernels._checks import compute_dtype
from csa_kernels._chunking import rows_per_chunk
from csa_kernels.ops.indexer_loss.checks import check_inputs as _check_inputs


def indexer_teacher_ref(
    q: torch.Tensor,
    kv_all: torch.Tensor,
    lse: torch.Tensor,
    comp_indices: torch.Tensor,
    softmax_scale: float,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Teacher ``log p [T, Kc]`` (module docstring), ``-inf`` at ``-1`` slots and on rows without valid slots.

    Computed without gradient (detached inputs). Rows with valid slots satisfy ``sum_s exp(log p) == 1``.
    """
    dt = compute_dtype(q, kv_all, lse)
    t, h, d = q.shape
    kc = comp_indices.shape[1]
    out = torch.full((t, kc), float("-inf"), dtype=dt, device=q.device)
    chunk = rows_per_chunk(kc * max(d, h), chunk_size)
    with torch.no_grad():
        qf, kvf, lsef = q.detach().to(dt), kv_all.detach().to(dt), lse.detach().to(dt)
        for s in range(0, t, chunk):
            e = min(s + chunk, t)
            idx = comp_indices[s:e]
            valid = idx >= 0  # [n, Kc]
            rows = kvf[idx.clamp(min=0).long()]  # [n, Kc, D]
            z = torch.einsum("nhd,nkd->nhk", qf[s:e], rows) * softmax_scale  # [n, H, Kc]
            log_pi = (z - lsef[s:e, :, None]).masked_fill(~valid[:, None, :], float("-inf"))
            log_mass = torch.logsumexp(log_pi, dim=1)  # [n, Kc]  sum over heads
            row_norm = torch.logsumexp(log_mass, dim=1, keepdim=True)  # [n, 1]
            has = valid.any(1, keepdim=True)
            out[s:e] = torch.where(has & valid, log_mass - torch.where(has, row_norm, 0.0), float("-inf"))
    return out


def indexer_loss_ref(
    q: torch.Tensor,
    kv_all: torch.Tensor,
    attn_sink: torch.Tensor,
    lse: torch.Tensor,
    comp_indices: torch.Tensor,
    index_scores: torch.Tensor,
    softmax_scale: float,
    chunk_size: int | None = None,
    *,
    check_indices: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(teacher || softmax(index_scores)) per row and its mean over rows with entries (module docstring).

    Args:
        q: ``[T, H, D]`` main-attention queries (detached inside).
        kv_all: ``[Nkv, D]`` the attention's key buffer ``cat([kv, entries])`` (detached inside).
        attn_sink: ``[H]``; only its shape is checked: the sink's mass is already inside ``lse``.
        lse: ``[T, H]`` full log-denominator returned by ``sparse_attn`` (detached inside).
        comp_indices: ``[T, Kc]`` int32 rows of ``kv_all`` (compressed rows, i.e. ``>= T``), ``-1`` = none.
        index_scores: ``[T, Kc]`` student logits at those slots (finite where ``comp_indices >= 0``).
        softmax_scale: the main attention's scale.
        chunk_size: teacher rows per chunk (default automatic).
        check_indices: ``False`` skips the range check of ``comp_indices`` (a device -> host sync); the caller
            guarantees ``-1 <= comp_indices < Nkv``, out-of-range values are undefined behaviour.
    Returns:
        ``loss`` (0-dim) and ``per_row_kl [T]`` (0 on rows without valid slots), compute dtype.
    """
    _check_inputs(q, kv_all, attn_sink, lse, comp_indices, index_scores, softmax_scale, check_indices)
    log_p = indexer_teacher_ref(q, kv_all, lse, comp_indices, softmax_scale, chunk_size)  # [T, Kc]
    valid = comp_indices >= 0
    has = valid.any(1)  # [T]
    scores = index_scores.to(log_p.dtype).masked_fill(~valid, float("-inf"))
    # rows without a valid slot: feed zeros so log_softmax stays finite; their KL is masked to 0 below
    log_r = torch.log_softmax(torch.where(has[:, None], scores, 0.0), dim=1)  # [T, Kc]
    p = torch.exp(log_p)
    terms = torch.where(valid, p * (log_p.masked_fill(~valid, 0.0) - log_r.masked_fill(~valid, 0.0)), 0.0)
    per_row = torch.where(has, terms.sum(1), 0.0)  # [T]
    loss = per_row.sum() / has.sum().clamp(min=1)  # rows with entries (no host sync)
    return loss, per_row
