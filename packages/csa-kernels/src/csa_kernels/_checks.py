"""Input validation shared by the public entry points (bad input -> ValueError saying what and how to fix)."""

from __future__ import annotations

import itertools

import torch


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """Reference math dtype: float64 if any floating input is float64, else float32 (bf16/fp16 are upcast)."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def check_cu_seqlens(
    cu_seqlens: torch.Tensor,
    name: str = "cu_seqlens",
    total: int | None = None,
    host: list[int] | tuple[int, ...] | None = None,
) -> list[int]:
    """Validate a flash-attn style ``cu_seqlens`` ([N+1], integer, starts at 0, non-decreasing); return it as a list.

    ``total`` (when given) must equal ``cu_seqlens[-1]``: the packed buffer holds exactly the documents' tokens
    (static-shape padding goes into a padding document of its own).

    ``host``: the caller's host copy of ``cu_seqlens`` (the ``*_host`` options of the public ops). When given, its
    structure is validated in Python and it is returned instead of ``cu_seqlens.tolist()`` (no device -> host
    sync); it is NOT compared with the device tensor (the caller guarantees they hold the same values).
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor (int32 [N+1]), got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must be 1-D [N+1] with N >= 0, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 (or int64), got {cu_seqlens.dtype}")
    if host is None:
        cu = [int(v) for v in cu_seqlens.tolist()]
    else:
        cu = check_host_cu_seqlens(host, f"{name}_host")
        if len(cu) != cu_seqlens.numel():
            raise ValueError(
                f"{name}_host has {len(cu)} values but {name} has {cu_seqlens.numel()}: pass the host copy of "
                f"the same {name}"
            )
        return _check_cu_values(cu, f"{name}_host", total)
    return _check_cu_values(cu, name, total)


def check_host_cu_seqlens(host, name: str = "cu_seqlens_host") -> list[int]:
    """A host ``cu_seqlens`` (list / tuple of Python ints, length >= 1); returned as a list (values checked by the
    caller with ``_check_cu_values``)."""
    if not isinstance(host, (list, tuple)) or not host:
        raise ValueError(f"{name} must be a non-empty list of ints [N+1], got {type(host).__name__}")
    if any(not isinstance(v, int) or isinstance(v, bool) for v in host):
        raise ValueError(f"{name} must hold Python ints, got {[type(v).__name__ for v in host][:4]}...")
    return list(host)


def _check_cu_values(cu: list[int], name: str, total: int | None) -> list[int]:
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


def check_flag(value: bool, name: str) -> None:
    """Boolean options (``check_indices``): a real bool, so a misplaced positional tensor is caught."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__}")


def check_ratio(ratio: int, overlap: bool | None = None) -> None:
    if not isinstance(ratio, int) or isinstance(ratio, bool) or ratio < 1:
        raise ValueError(f"ratio must be a positive int, got {ratio!r}")
    if overlap is not None and not isinstance(overlap, bool):
        raise ValueError(f"overlap must be a bool, got {overlap!r}")


def check_shape(t: torch.Tensor, name: str, shape: tuple[int | None, ...]) -> None:
    """``shape`` entries of ``None`` match any size."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")


def check_float(t: torch.Tensor, name: str) -> None:
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got {t.dtype}")


def check_index_layout(t: torch.Tensor, name: str, rows: int) -> None:
    """Index tensors: int32/int64 ``[rows, K]`` (shape and dtype only, no device sync)."""
    check_shape(t, name, (rows, None))
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 (or int64), got {t.dtype}")


def check_index_range(
    t: torch.Tensor, name: str, upper: int, rows_of: str | None = None, enabled: bool = True
) -> None:
    """Index values in ``[-1, upper)`` (-1 = empty slot); ``rows_of`` names the buffer of local rows (SBHD forms).

    One device -> host sync (min / max). ``enabled=False`` (the public ``check_indices=False``) skips it: the caller
    guarantees the range, and out-of-range values are then undefined behaviour (garbage or a device-side fault).
    """
    check_flag(enabled, "check_indices")
    if enabled and t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < -1 or hi >= upper:
            what = f"local rows of {rows_of}" if rows_of else "-1 = empty slot"
            raise ValueError(f"{name} values must lie in [-1, {upper}) ({what}), got range [{lo}, {hi}]")


def check_index(t: torch.Tensor, name: str, rows: int, upper: int, enabled: bool = True) -> None:
    """Index tensors: int32/int64 ``[rows, K]`` with values in ``[-1, upper)`` (-1 = empty slot; range check only
    when ``enabled``)."""
    check_index_layout(t, name, rows)
    check_index_range(t, name, upper, enabled=enabled)


def check_softmax_scale(softmax_scale: float) -> None:
    if not isinstance(softmax_scale, (int, float)) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive float, got {softmax_scale!r}")


def check_topk(topk: int) -> None:
    if not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
