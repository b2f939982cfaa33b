"""Public lightning-indexer entry points: THD (global compressed rows) and SBHD (per-sequence local entry ids)."""

from __future__ import annotations

import torch

from csa_kernels._checks import check_shape
from csa_kernels.ops.indexer import scores_at_autograd  # looked up per call: tests wrap its entry point
from csa_kernels.ops.indexer.checks import check_scores_at_inputs
from csa_kernels.ops.indexer.reference import indexer_scores_at_ref, indexer_scores_ref, indexer_topk_ref
from csa_kernels.ops.indexer.scores_autograd import indexer_scores_triton_checked
from csa_kernels.ops.indexer.triton import indexer_topk_checked
from dsv4_primitives.dispatch import resolve_backend
from dsv4_primitives.varlen import (
    compressed_cu_seqlens_host,
    sbhd_cu_seqlens_host,
    sbhd_to_thd,
    thd_to_sbhd,
    upload_host_ints,
)

_HOST_DOC = """
    ``cu_seqlens_host`` / ``cu_seqlens_c_host``: the caller's host copies of ``cu_seqlens`` / ``cu_seqlens_c``
    (structure validated in Python and against each other, not compared with the device tensors); with both the
    call, backward included, does no device -> host sync."""


def indexer_scores(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    ratio: int,
    cu_seqlens: torch.Tensor,
    cu_seqlens_c: torch.Tensor,
    max_entries: int | None = None,
    chunk_size: int | None = None,
    *,
    backend: str = "auto",
    cu_seqlens_host: list[int] | None = None,
    cu_seqlens_c_host: list[int] | None = None,
) -> torch.Tensor:
    """Dense index scores ``[T, max_entries]`` (column = local entry, ``-inf`` invisible): :func:`indexer_scores_ref`."""
    args = (q_idx, k_idx, weights, ratio, cu_seqlens, cu_seqlens_c, max_entries, chunk_size)
    hosts = dict(cu_seqlens_host=cu_seqlens_host, cu_seqlens_c_host=cu_seqlens_c_host)
    if resolve_backend(backend, q_idx, k_idx, op="csa_kernels.indexer_scores") == "triton":
        return indexer_scores_triton_checked(*args, **hosts)
    return indexer_scores_ref(*args, **hosts)


indexer_scores.__doc__ += _HOST_DOC


def indexer_scores_at(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    chunk_size: int | None = None,
    *,
    backend: str = "auto",
    check_indices: bool = True,
    deterministic: bool | None = None,
) -> torch.Tensor:
    """Index scores ``[T, K]`` at global compressed rows ``indices`` (``-inf`` at -1): :func:`indexer_scores_at_ref`.

    Triton path: fused forward and backward (:mod:`csa_kernels.ops.indexer.scores_at_triton`), fp32 output,
    ``chunk_size`` unused (nothing larger than ``[T, K]`` is formed). ``check_indices=False`` skips the range
    check of ``indices`` (one device -> host sync); the caller guarantees ``-1 <= indices < Tc``, out-of-range
    values are then undefined behaviour. ``deterministic`` (Triton): ``True`` computes the backward's ``dk`` by
    the atomic-free key-major pass (bitwise reproducible), ``False`` with fp32 atomics, ``None`` (default) follows
    ``torch.are_deterministic_algorithms_enabled()``.
    """
    if resolve_backend(backend, q_idx, k_idx, op="csa_kernels.indexer_scores_at") == "triton":
        check_scores_at_inputs(q_idx, k_idx, weights, indices, check_indices)
        return scores_at_autograd.indexer_scores_at_triton(q_idx, k_idx, weights, indices, deterministic)
    return indexer_scores_at_ref(q_idx, k_idx, weights, indices, chunk_size, check_indices=check_indices)


def indexer_topk(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    ratio: int,
    topk: int,
    cu_seqlens: torch.Tensor,
    cu_seqlens_c: torch.Tensor,
    chunk_size: int | None = None,
    *,
    backend: str = "auto",
    cu_seqlens_host: list[int] | None = None,
    cu_seqlens_c_host: list[int] | None = None,
    deterministic: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k compressed entries per query: ``(indices [T, topk] int32 global rows, -1 padded; scores [T, topk])``.

    Math, tie rule and memory: :func:`indexer_topk_ref`. ``deterministic``: as in :func:`indexer_scores_at`
    (the gradient of the returned scores; the selection itself is deterministic on both backends).
    """
    args = (q_idx, k_idx, weights, ratio, topk, cu_seqlens, cu_seqlens_c, chunk_size)
    hosts = dict(cu_seqlens_host=cu_seqlens_host, cu_seqlens_c_host=cu_seqlens_c_host)
    if resolve_backend(backend, q_idx, k_idx, op="csa_kernels.indexer_topk") == "triton":
        return indexer_topk_checked(*args, **hosts, deterministic=deterministic)
    return indexer_topk_ref(*args, **hosts)


indexer_topk.__doc__ += _HOST_DOC


def _sbhd_args(q_idx, k_idx, weights, ratio):
    """Shapes of the SBHD forms; ``(S, B, cu, cuc, host lists)`` (built on the host: no device sync)."""
    check_shape(q_idx, "q_idx", (None, None, None, None))
    s, b = q_idx.shape[:2]
    check_shape(k_idx, "k_idx", (s // ratio, b, q_idx.shape[3]))
    check_shape(weights, "weights", (s, b, q_idx.shape[2]))
    cu_l = sbhd_cu_seqlens_host(b, s)
    cuc_l = compressed_cu_seqlens_host(cu_l, ratio)
    cu, cuc = upload_host_ints(cu_l, q_idx.device), upload_host_ints(cuc_l, q_idx.device)
    return s, b, cu, cuc, dict(cu_seqlens_host=cu_l, cu_seqlens_c_host=cuc_l)


def indexer_scores_sbhd(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    ratio: int,
    chunk_size: int | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """SBHD form: ``q_idx [S, B, HI, DI]``, ``k_idx [S // ratio, B, DI]``, ``weights [S, B, HI]`` ->
    ``[S, B, S // ratio]`` (column = the sequence's entry id, ``-inf`` invisible)."""
    s, b, cu, cuc, hosts = _sbhd_args(q_idx, k_idx, weights, ratio)
    out = indexer_scores(
        sbhd_to_thd(q_idx),
        sbhd_to_thd(k_idx),
        sbhd_to_thd(weights),
        ratio,
        cu,
        cuc,
        max_entries=s // ratio,
        chunk_size=chunk_size,
        backend=backend,
        **hosts,
    )
    return thd_to_sbhd(out, b)


def indexer_topk_sbhd(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    ratio: int,
    topk: int,
    chunk_size: int | None = None,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """SBHD form of :func:`indexer_topk`: ``indices [S, B, topk]`` LOCAL entry ids of each sequence (``-1`` empty),
    ``scores [S, B, topk]``."""
    s, b, cu, cuc, hosts = _sbhd_args(q_idx, k_idx, weights, ratio)
    idx, scores = indexer_topk(
        sbhd_to_thd(q_idx),
        sbhd_to_thd(k_idx),
        sbhd_to_thd(weights),
        ratio,
        topk,
        cu,
        cuc,
        chunk_size,
        backend=backend,
        **hosts,
    )
    idx = thd_to_sbhd(idx, b).to(torch.int64)
    base = (torch.arange(b, device=idx.device) * (s // ratio))[None, :, None]
    local = torch.where(idx >= 0, idx - base, -1).to(torch.int32)
    return local, thd_to_sbhd(scores, b)
