"""NaN poisoning: pre-fill outputs with NaN so a kernel that forgets to write an element fails loudly."""

import torch


def nan_poison(shape, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """An uninitialised-looking output buffer filled with NaN (integer dtypes get their minimum value)."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype, device=device)


def assert_fully_written(name: str, t: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Assert no NaN (or int-min sentinel) survives in ``t`` (restricted to ``mask`` when given)."""
    view = t if mask is None else t[mask]
    if t.dtype.is_floating_point:
        bad = torch.isnan(view)
    else:
        bad = view == torch.iinfo(t.dtype).min
    n = int(bad.sum())
    if n:
        raise AssertionError(f"{name}: {n} of {view.numel()} elements were never written (still poisoned)")
