"""Input validation shared by the public entry points (bad input -> ValueError saying what and how to fix).

The boundaries themselves are validated when their :class:`~dsv4_primitives.varlen.SeqBoundaries` is built.
"""

from __future__ import annotations

import torch

from dsv4_primitives.varlen import SeqBoundaries
from dsv4_primitives.varlen import check_ratio as _check_ratio_value


def check_bounds(
    bounds: SeqBoundaries, total: int | None = None, rows_of: str = "the input"
) -> SeqBoundaries:
    """``bounds`` is a :class:`SeqBoundaries` over ``total`` rows (``rows_of`` names the tensor whose leading dim
    ``total`` is)."""
    if not isinstance(bounds, SeqBoundaries):
        raise ValueError(
            f"bounds must be a dsv4_primitives.varlen.SeqBoundaries, got {type(bounds).__name__}; build one with "
            "SeqBoundaries.from_host / from_lengths / from_tensor (or SeqBoundaries.static for CUDA graphs)"
        )
    if total is not None and bounds.total != total:
        what = "the row capacity" if bounds.is_static else "cu_seqlens[-1]"
        raise ValueError(
            f"the boundaries cover {bounds.total} rows ({what}) but {rows_of} has {total}, the number of packed rows; "
            "put static-shape padding into a padding document of its own"
        )
    return bounds


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """Reference math dtype: float64 if any floating input is float64, else float32 (bf16/fp16 are upcast)."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def check_flag(value: bool, name: str) -> None:
    """Boolean options (``check_indices``): a real bool, so a misplaced positional tensor is caught."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__}")


def check_ratio(ratio: int, overlap: bool | None = None) -> None:
    _check_ratio_value(ratio)
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
