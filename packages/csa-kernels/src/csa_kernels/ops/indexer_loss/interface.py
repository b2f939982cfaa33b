"""Public indexer-loss entry points: THD (global rows of ``kv_all``) and SBHD (per-sequence local rows)."""

from __future__ import annotations

import torch

from csa_kernels._checks import check_index_range, check_shape
from csa_kernels.ops.indexer_loss.autograd import indexer_loss_triton
from csa_kernels.ops.indexer_loss.reference import indexer_loss_ref
from csa_kernels.ops.sparse_attn.interface import local_to_global_rows
from dsv4_primitives.dispatch import resolve_backend
from dsv4_primitives.varlen import sbhd_to_thd, thd_to_sbhd


def indexer_loss(
    q: torch.Tensor,
    kv_all: torch.Tensor,
    attn_sink: torch.Tensor,
    lse: torch.Tensor,
    comp_indices: torch.Tensor,
    index_scores: torch.Tensor,
    softmax_scale: float,
    *,
    backend: str = "auto",
    check_indices: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer KL loss, THD: ``(loss, per_row_kl [T])``; gradient only into ``index_scores``. :func:`indexer_loss_ref`.

    ``check_indices=False`` skips the range check of ``comp_indices`` (one device -> host sync); the caller
    guarantees ``-1 <= comp_indices < Nkv``, out-of-range values are then undefined behaviour.
    """
    args = (q, kv_all, attn_sink, lse, comp_indices, index_scores, softmax_scale)
    if resolve_backend(backend, q, kv_all, op="csa_kernels.indexer_loss") == "triton":
        return indexer_loss_triton(*args, check_indices=check_indices)
    return indexer_loss_ref(*args, check_indices=check_indices)


def indexer_loss_sbhd(
    q: torch.Tensor,
    kv_all: torch.Tensor,
    attn_sink: torch.Tensor,
    lse: torch.Tensor,
    comp_indices: torch.Tensor,
    index_scores: torch.Tensor,
    softmax_scale: float,
    *,
    backend: str = "auto",
    check_indices: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SBHD form: ``q [S, B, H, D]``, ``kv_all [Skv, B, D]``, ``lse [S, B, H]``, ``comp_indices [S, B, Kc]`` LOCAL
    rows of each sequence's ``kv_all`` (``-1`` none), ``index_scores [S, B, Kc]`` -> ``(loss, per_row_kl [S, B])``;
    the loss is the mean over all rows (of every sequence) with entries. ``check_indices``: as in
    :func:`indexer_loss` (the local range ``[-1, Skv)`` is checked here)."""
    check_shape(q, "q", (None, None, None, None))
    s, b = q.shape[:2]
    check_shape(kv_all, "kv_all", (None, b, q.shape[3]))
    check_shape(comp_indices, "comp_indices", (s, b, None))
    check_shape(index_scores, "index_scores", tuple(comp_indices.shape))
    check_index_range(comp_indices, "comp_indices", kv_all.shape[0], rows_of="kv_all", enabled=check_indices)
    loss, per_row = indexer_loss(
        sbhd_to_thd(q),
        sbhd_to_thd(kv_all),
        attn_sink,
        sbhd_to_thd(lse),
        local_to_global_rows(comp_indices, kv_all.shape[0]),
        sbhd_to_thd(index_scores),
        softmax_scale,
        backend=backend,
        check_indices=False,  # local rows checked above; their global rows are in range by construction
    )
    return loss, thd_to_sbhd(per_row, b)
