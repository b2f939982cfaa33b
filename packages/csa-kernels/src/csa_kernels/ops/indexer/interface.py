"""Public lightning-indexer entry points: THD (global compressed rows) and SBHD (per-sequence local entry ids)."""

from __future__ import annotations

import torch

from csa_kernels._checks import check_bounds, check_shape, check_topk
from csa_kernels.ops.indexer import scores_at_autograd  # looked up per call: tests wrap its entry point
from csa_kernels.ops.indexer.checks import check_inputs, check_scores_at_inputs, check_scores_inputs
from csa_kernels.ops.indexer.device_plan import indexer_topk_device_planned
from csa_kernels.ops.indexer.reference import indexer_scores_at_ref, indexer_scores_ref, indexer_topk_ref
from csa_kernels.ops.indexer.scores_at_autograd import attach_scores_at_grad
from csa_kernels.ops.indexer.scores_autograd import indexer_scores_triton_checked
from csa_kernels.ops.indexer.triton import indexer_topk_triton
from csa_kernels.ops.visibility.rules import visible_compressed_indices
from dsv4_primitives.dispatch import resolve_backend
from dsv4_primitives.varlen import SeqBoundaries, sbhd_cu_seqlens_host, sbhd_to_thd, thd_to_sbhd


def indexer_scores(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    ratio: int,
    bounds: SeqBoundaries,
    max_entries: int | None = None,
    chunk_size: int | None = None,
    *,
    backend: str = "auto",
    deterministic: bool | None = None,
) -> torch.Tensor:
    """Dense index scores ``[T, max_entries]`` (column = local entry, ``-inf`` invisible): :func:`indexer_scores_ref`.

    Host boundaries: no device -> host sync, forward or backward. Static boundaries (CUDA graphs): ``k_idx`` holds
    the entry capacity ``T // ratio`` rows and the width is at least that capacity; the scores are
    :func:`indexer_scores_at` at the visible entries on both backends (fused forward and backward, nothing read
    back: the same fp32 math summed in another order). ``deterministic``: that path's ``dk`` (see
    :func:`indexer_scores_at`).
    """
    if check_bounds(bounds).is_static:
        max_entries = check_scores_inputs(q_idx, k_idx, weights, ratio, bounds, max_entries)
        visible = visible_compressed_indices(
            bounds, ratio, max_entries
        )  # [T, max_entries] global rows, -1 padded
        return indexer_scores_at(
            q_idx, k_idx, weights, visible, backend=backend, check_indices=False, deterministic=deterministic
        )
    args = (q_idx, k_idx, weights, ratio, bounds, max_entries, chunk_size)
    if resolve_backend(backend, q_idx, k_idx, op="csa_kernels.indexer_scores") == "triton":
        return indexer_scores_triton_checked(*args)
    return indexer_scores_ref(*args)


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
    values are then undefined behaviour. ``deterministic`` (Triton): ``True`` computes the backward's ``dk``
    without atomics (bitwise reproducible; the key-major pass by default, ``scores_at_config.DETERMINISTIC_DK``),
    ``False`` with fp32 atomics (faster, summation order varies), ``None`` (default): the process-wide
    :func:`csa_kernels.deterministic_default` (``True`` unless :func:`csa_kernels.set_deterministic_default`
    changed it) or ``torch.are_deterministic_algorithms_enabled()``.
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
    bounds: SeqBoundaries,
    chunk_size: int | None = None,
    *,
    backend: str = "auto",
    deterministic: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k compressed entries per query: ``(indices [T, topk] int32 global rows, -1 padded; scores [T, topk])``.

    Math, tie rule and memory: :func:`indexer_topk_ref`. ``deterministic``: as in :func:`indexer_scores_at`
    (the gradient of the returned scores; the selection itself is deterministic on both backends). Host
    boundaries: no device -> host sync, forward or backward. Static boundaries (CUDA graphs): ``k_idx`` holds the
    entry capacity ``T // ratio`` rows (padding rows are never selected); the Triton path plans its launches on
    the device (capturable; bitwise the host result at one row chunk), the reference path reads the boundaries
    back (CPU; never captured).
    """
    if resolve_backend(backend, q_idx, k_idx, op="csa_kernels.indexer_topk") != "triton":
        return indexer_topk_ref(q_idx, k_idx, weights, ratio, topk, bounds, chunk_size)

    check_inputs(q_idx, k_idx, weights, ratio, bounds)
    check_topk(topk)
    # launches planned from the host copy, or on the device for static boundaries (capturable)
    select = indexer_topk_device_planned if bounds.is_static else indexer_topk_triton
    idx, vals = select(q_idx.detach(), k_idx.detach(), weights.detach(), ratio, topk, bounds, chunk_size)
    # forward value = the selection pass's scores; backward = the fused kernel at the selected entries
    return idx, attach_scores_at_grad(vals, q_idx, k_idx, weights, idx, deterministic)


def _sbhd_args(q_idx, k_idx, weights, ratio):
    """Shapes of the SBHD forms; ``(S, B, bounds)`` (built on the host: no device sync)."""
    check_shape(q_idx, "q_idx", (None, None, None, None))
    s, b = q_idx.shape[:2]
    check_shape(k_idx, "k_idx", (s // ratio, b, q_idx.shape[3]))
    check_shape(weights, "weights", (s, b, q_idx.shape[2]))
    return s, b, SeqBoundaries.from_host(sbhd_cu_seqlens_host(b, s), q_idx.device)


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
    s, b, bounds = _sbhd_args(q_idx, k_idx, weights, ratio)
    out = indexer_scores(
        sbhd_to_thd(q_idx),
        sbhd_to_thd(k_idx),
        sbhd_to_thd(weights),
        ratio,
        bounds,
        max_entries=s // ratio,
        chunk_size=chunk_size,
        backend=backend,
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
    s, b, bounds = _sbhd_args(q_idx, k_idx, weights, ratio)
    idx, scores = indexer_topk(
        sbhd_to_thd(q_idx),
        sbhd_to_thd(k_idx),
        sbhd_to_thd(weights),
        ratio,
        topk,
        bounds,
        chunk_size,
        backend=backend,
    )
    idx = thd_to_sbhd(idx, b).to(torch.int64)
    base = (torch.arange(b, device=idx.device) * (s // ratio))[None, :, None]
    local = torch.where(idx >= 0, idx - base, -1).to(torch.int32)
    return local, thd_to_sbhd(scores, b)
