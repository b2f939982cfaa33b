"""Public sparse-attention entry points: THD (global rows) and SBHD (per-sequence local rows)."""

from __future__ import annotations

import torch

from csa_kernels._checks import check_index_range, check_shape
from csa_kernels.ops.sparse_attn.autograd import sparse_attn_triton
from csa_kernels.ops.sparse_attn.reference import sparse_attn_ref
from dsv4_primitives.dispatch import resolve_backend
from dsv4_primitives.varlen import sbhd_to_thd, thd_to_sbhd


def sparse_attn(
    q: torch.Tensor,
    kv: torch.Tensor,
    attn_sink: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    *,
    backend: str = "auto",
    check_indices: bool = True,
    deterministic: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared-KV sparse attention with sink, THD: ``(o [T, H, D], lse [T, H])``. Math: :func:`sparse_attn_ref`.

    ``check_indices=False`` skips the checks that need a device -> host sync (``indices`` in ``[-1, Nkv)``, finite
    ``attn_sink``; both backends): the caller guarantees them, violations are undefined behaviour.
    ``deterministic`` (Triton backend): ``True`` computes the backward's ``dkv`` without atomics (per-pair rows
    summed per kv row over an inverted index; bitwise reproducible, cost independent of index collisions),
    ``False`` with fp32 atomics (faster, summation order varies), ``None`` (default): the process-wide
    :func:`csa_kernels.deterministic_default` (``True`` unless :func:`csa_kernels.set_deterministic_default`
    changed it) or ``torch.are_deterministic_algorithms_enabled()``. The reference backend is deterministic on CPU, and on CUDA
    under ``torch.use_deterministic_algorithms(True)``.
    """
    if resolve_backend(backend, q, kv, op="csa_kernels.sparse_attn") == "triton":
        return sparse_attn_triton(
            q, kv, attn_sink, indices, softmax_scale, check_indices=check_indices, deterministic=deterministic
        )
    return sparse_attn_ref(q, kv, attn_sink, indices, softmax_scale, check_indices=check_indices)


def local_to_global_rows(indices: torch.Tensor, rows_per_seq: int) -> torch.Tensor:
    """``[S, B, K]`` per-sequence rows -> ``[B*S, K]`` rows into the flattened ``[B * rows_per_seq, ...]`` buffer."""
    b = indices.shape[1]
    base = (torch.arange(b, device=indices.device, dtype=torch.int64) * rows_per_seq)[None, :, None]
    idx = indices.to(torch.int64)
    glob = torch.where(idx >= 0, idx + base, -1)  # [S, B, K]
    return sbhd_to_thd(glob).to(torch.int32)


def sparse_attn_sbhd(
    q: torch.Tensor,
    kv: torch.Tensor,
    attn_sink: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    *,
    backend: str = "auto",
    check_indices: bool = True,
    deterministic: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SBHD form: ``q [S, B, H, D]``, ``kv [Skv, B, D]``, ``indices [S, B, K]`` LOCAL rows of each sequence's ``kv``
    (``-1`` = empty) -> ``o [S, B, H, D]``, ``lse [S, B, H]``. ``kv`` is typically ``cat([kv, entries], 0)``.
    ``check_indices``, ``deterministic``: as in :func:`sparse_attn` (the local range ``[-1, Skv)`` is checked
    here)."""
    check_shape(q, "q", (None, None, None, None))
    s, b = q.shape[:2]
    check_shape(kv, "kv", (None, b, q.shape[3]))
    check_shape(indices, "indices", (s, b, None))
    check_index_range(indices, "indices", kv.shape[0], rows_of="kv", enabled=check_indices)
    o, lse = sparse_attn(
        sbhd_to_thd(q),
        sbhd_to_thd(kv),
        attn_sink,
        local_to_global_rows(indices, kv.shape[0]),
        softmax_scale,
        backend=backend,
        check_indices=check_indices,
        deterministic=deterministic,
    )
    return thd_to_sbhd(o, b), thd_to_sbhd(lse, b)
