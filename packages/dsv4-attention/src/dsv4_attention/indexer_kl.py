"""The indexer KL term of one CSA layer over a loss set (spec §5.2), shared by the single-rank core and the
context-parallel forward.

For query row ``t`` with loss set ``S_t`` (compressed entries, ``-1`` padded), teacher ``p`` = the main attention's
probabilities of those entries under its full denominator (``lse``, sink included), summed over heads and
L1-normalised over ``S_t``; student ``q`` = ``softmax(student_logits[t, S_t])``:

    KL_t = sum_{j in S_t} p_tj * (log p_tj - log q_tj)

Rows with an empty loss set or that are not real tokens count zero. Inputs of the teacher are detached (the indexer
is trained only by this loss; oracle I3).
"""

from __future__ import annotations

import torch

from dsv4_attention._kernels import attention_indices, indexer_loss


def indexer_kl_sum(
    q: torch.Tensor,
    kv_all: torch.Tensor,
    attn_sink: torch.Tensor,
    lse: torch.Tensor,
    loss_set: torch.Tensor,
    student_logits: torch.Tensor,
    softmax_scale: float,
    num_token_rows: int,
    real_rows: torch.Tensor | None,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of KL_t over counted rows, counted rows bool [T])``.

    Args:
        q: ``[T, n_h, c]`` queries; kv_all: ``[N + Tc, c]`` token rows then compressed entries; attn_sink: ``[n_h]``;
        lse: ``[T, n_h]`` of the main attention; loss_set: ``[T, K]`` compressed entry ids (``-1`` padded);
        student_logits: ``[T, K]`` index scores aligned with ``loss_set``; num_token_rows: ``N``, the number of token
        rows before the compressed entries in ``kv_all``; real_rows: bool ``[T]`` or ``None`` (all real).
    """
    valid = loss_set >= 0  # [T, K]
    student = torch.where(valid, student_logits, torch.zeros_like(student_logits))
    teacher_idx = attention_indices(loss_set[:, :0], loss_set, num_token_rows)  # rows of kv_all, -1 kept
    _, per_row = indexer_loss(
        q.detach(),
        kv_all.detach(),
        attn_sink.detach(),
        lse.detach(),
        teacher_idx,
        student,
        softmax_scale,
        backend=backend,
        check_indices=False,
    )  # [T]
    rows = valid.any(-1)
    if real_rows is not None:
        rows = rows & real_rows
    return torch.where(rows, per_row, torch.zeros_like(per_row)).sum(), rows
