"""The indexer KL term of one CSA layer under tensor parallelism: the teacher sums the main attention's
probabilities over ALL heads, and the heads are split over the TP ranks (spec §5.2; the single-rank form is
:mod:`dsv4_attention.indexer_kl`).

Rank ``r`` holds heads ``H_r`` for every query row ``t`` of the sequence and the student (index scores) of its own
rows only. With ``log pi[h,t,s] = z[h,t,s] - lse[t,h]`` (the full denominator of head ``h``, sink included):

    lm_r[t,s]  = logsumexp_{h in H_r} log pi[h,t,s]              # [T, K] head-partial log-mass, all rows
    lm[t,s]    = logsumexp_r lm_r[t,s]                           # [L, K] this rank's rows: one all-to-all
    log p[t,s] = lm[t,s] - logsumexp_s' lm[t,s']                 # L1-normalised teacher
    KL_t       = sum_s p[t,s] (log p[t,s] - log_softmax(student[t])_s)

so ``lm`` is the single-rank teacher's log-mass over every head, combined in the log domain (no ``exp``
underflow). The teacher is detached; the gradient reaches only the student (``(softmax - p) * dKL``).
Memory: the head-partial teacher is built in chunks of rows (``[n, K, c]`` gathered entries, ``[n, H_r, K]`` logits).
"""

from __future__ import annotations

import torch

from dsv4_attention._kernels import attention_indices
from dsv4_attention.tp.comm import logsumexp_to_rows

CHUNK_ELEMENTS = 1 << 24  # bound of one chunk's [n, K, max(c, H_r)] intermediate


def head_partial_log_mass(
    q: torch.Tensor, kv_all: torch.Tensor, lse: torch.Tensor, rows_idx: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """``lm_r [T, K]`` fp32 (fp64 with fp64 inputs): ``logsumexp`` over this rank's heads of ``z - lse`` at the rows
    ``rows_idx [T, K]`` of ``kv_all`` (``-1``: ``-inf``). ``q [T, H_r, c]``, ``kv_all [N, c]``, ``lse [T, H_r]``."""
    dt = torch.float64 if torch.float64 in (q.dtype, kv_all.dtype, lse.dtype) else torch.float32
    t, h, c = q.shape
    k = rows_idx.shape[1]
    out = torch.full((t, k), float("-inf"), dtype=dt, device=q.device)
    n = max(1, CHUNK_ELEMENTS // max(1, k * max(c, h)))
    with torch.no_grad():
        qf, kvf, lsef = q.detach().to(dt), kv_all.detach().to(dt), lse.detach().to(dt)
        for s in range(0, t, n):
            e = min(s + n, t)
            idx = rows_idx[s:e]
            valid = idx >= 0  # [n, K]
            keys = kvf[idx.clamp(min=0).long()]  # [n, K, c]
            z = torch.einsum("nhd,nkd->nhk", qf[s:e], keys) * softmax_scale  # [n, H_r, K]
            log_pi = (z - lsef[s:e, :, None]).masked_fill(~valid[:, None, :], float("-inf"))
            out[s:e] = torch.logsumexp(log_pi, dim=1)  # [n, K]
    return out


def tp_indexer_kl_sum(
    q: torch.Tensor,
    kv_all: torch.Tensor,
    lse: torch.Tensor,
    loss_set: torch.Tensor,
    student_logits: torch.Tensor,
    softmax_scale: float,
    num_token_rows: int,
    local_rows: slice,
    real_rows: torch.Tensor | None,
    group,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of KL_t over this rank's counted rows, counted rows bool [L])`` (module docstring).

    Args:
        q: ``[T, H_r, c]`` this rank's heads of every query row; kv_all: ``[N + Tc, c]``; lse: ``[T, H_r]``.
        loss_set: ``[T, K]`` compressed entry ids of every row (``-1`` padded; identical on every TP rank).
        student_logits: ``[L, K]`` index scores of this rank's rows, aligned with ``loss_set[local_rows]``.
        num_token_rows: ``N`` token rows before the entries in ``kv_all``; local_rows: this rank's rows of ``T``.
        real_rows: bool ``[L]`` of this rank's rows or ``None``; group: the TP group.
    """
    teacher_idx = attention_indices(loss_set[:, :0], loss_set, num_token_rows)  # [T, K] rows of kv_all
    lm = logsumexp_to_rows(head_partial_log_mass(q, kv_all, lse, teacher_idx, softmax_scale), group)  # [L, K]
    own = loss_set[local_rows]  # [L, K]
    valid = own >= 0
    has = valid.any(1)  # [L]
    log_p = lm - torch.where(has, torch.logsumexp(lm, dim=1), 0.0)[:, None]  # -inf at invalid slots
    scores = student_logits.to(lm.dtype).masked_fill(~valid, float("-inf"))
    log_r = torch.log_softmax(torch.where(has[:, None], scores, 0.0), dim=1)  # [L, K]
    p = torch.exp(log_p)
    terms = torch.where(valid, p * (log_p.masked_fill(~valid, 0.0) - log_r.masked_fill(~valid, 0.0)), 0.0)
    per_row = torch.where(has, terms.sum(1), 0.0)  # [L]
    rows = has if real_rows is None else has & real_rows
    return torch.where(rows, per_row, torch.zeros_like(per_row)).sum(), rows
