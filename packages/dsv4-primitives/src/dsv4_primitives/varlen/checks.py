"""Validation of packed-layout boundaries (bad input -> ``ValueError`` saying what and how to fix).

Convention (flash-attn varlen): ``cu_seqlens`` is integer ``[N+1]``, starts at 0 and is non-decreasing; document
``i`` owns packed rows ``cu_seqlens[i] .. cu_seqlens[i+1]-1`` (empty documents allowed). A *host copy* is a list or
tuple of Python ints holding the same values (what a host-mode ``SeqBoundaries`` carries: validation without a
device sync).
"""

from __future__ import annotations

import itertools

import torch


def check_cu_seqlens(
    cu_seqlens: torch.Tensor,
    name: str = "cu_seqlens",
    total: int | None = None,
    host: list[int] | tuple[int, ...] | None = None,
) -> list[int]:
    """Validate a flash-attn style ``cu_seqlens`` ([N+1], integer, starts at 0, non-decreasing); return it as a list.

    ``total`` (when given) must equal ``cu_seqlens[-1]``: the packed buffer holds exactly the documents' tokens
    (static-shape padding goes into a padding document of its own).

    ``host``: the caller's host copy of ``cu_seqlens``. When given, its structure is validated in Python and it is
    returned instead of ``cu_seqlens.tolist()`` (no device -> host sync); it is NOT compared with the device tensor
    (the caller guarantees they hold the same values).
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor (int32 [N+1]), got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must be 1-D [N+1] with N >= 0, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 (or int64), got {cu_seqlens.dtype}")
    if host is None:
        return check_cu_values([int(v) for v in cu_seqlens.tolist()], name, total)
    cu = check_host_cu_seqlens(host, f"{name}_host")
    if len(cu) != cu_seqlens.numel():
        raise ValueError(
            f"{name}_host has {len(cu)} values but {name} has {cu_seqlens.numel()}: pass the host copy of "
            f"the same {name}"
        )
    return check_cu_values(cu, f"{name}_host", total)


def check_host_cu_seqlens(host, name: str = "cu_seqlens_host") -> list[int]:
    """A host ``cu_seqlens`` (list / tuple of Python ints, length >= 1); returned as a list (values are checked by
    :func:`check_cu_values`)."""
    if not isinstance(host, (list, tuple)) or not host:
        raise ValueError(f"{name} must be a non-empty list of ints [N+1], got {type(host).__name__}")
    if any(not isinstance(v, int) or isinstance(v, bool) for v in host):
        raise ValueError(f"{name} must hold Python ints, got {[type(v).__name__ for v in host][:4]}...")
    return list(host)


def check_cu_values(cu: list[int], name: str = "cu_seqlens", total: int | None = None) -> list[int]:
    """The values of a host ``cu_seqlens``: start at 0, non-decreasing, and end at ``total`` when given."""
    if cu[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {cu[0]}")
    if any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError(f"{name} must be non-decreasing (document lengths >= 0), got {cu}")
    if total is not None and cu[-1] != total:
        raise ValueError(
            f"{name}[-1] = {cu[-1]} must equal the number of packed rows ({total}); put static-shape padding "
            "into a padding document of its own"
        )
    return cu


def check_ratio(ratio: int) -> None:
    """A compression ratio: a positive Python int."""
    if not isinstance(ratio, int) or isinstance(ratio, bool) or ratio < 1:
        raise ValueError(f"ratio must be a positive int, got {ratio!r}")
