"""NaN poisoning: pre-fill outputs with NaN so a kernel that forgets to write an element fails loudly.

Two tools:

- :func:`nan_poison` / :func:`assert_fully_written`: an explicitly poisoned buffer and the check that every element
  was overwritten (for a test that owns the output buffer).
- :func:`poison_allocations`: while active, every fresh ``torch.empty`` / ``empty_like`` / ``empty_strided`` /
  ``Tensor.new_empty`` allocation comes back filled with NaN (floating and complex dtypes) or with an integer
  sentinel (the dtype's minimum; maximum for unsigned dtypes). Kernel wrappers allocate their outputs with these,
  so a kernel that skips an output slot leaves a NaN that the test's comparison against the reference catches.
  The testkit's pytest plugin turns it on for every test (an autouse fixture); a test that legitimately needs
  uninitialised memory opts out with ``@pytest.mark.no_nan_poison``.
"""

from __future__ import annotations

import contextlib
import functools

import torch


def sentinel(dtype: torch.dtype) -> float | int | None:
    """The poison value of ``dtype``: NaN for floating / complex, the minimum (maximum if unsigned) for integers,
    ``None`` for bool (nothing to poison with)."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return None
    info = torch.iinfo(dtype)
    return info.max if info.min == 0 else info.min


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


def _poison_(t: torch.Tensor) -> torch.Tensor:
    value = sentinel(t.dtype)
    if value is not None and t.layout == torch.strided and t.device.type != "meta" and t.numel():
        with torch.no_grad():
            t.fill_(value)
    return t


def _poisoning(alloc):
    @functools.wraps(alloc)
    def wrapper(*args, **kwargs):
        return _poison_(alloc(*args, **kwargs))

    wrapper.__wrapped_allocator__ = alloc
    return wrapper


_TARGETS = ((torch, "empty"), (torch, "empty_like"), (torch, "empty_strided"), (torch.Tensor, "new_empty"))


@contextlib.contextmanager
def poison_allocations():
    """Fill every fresh ``torch.empty``-family allocation with the poison of its dtype for the duration of the block
    (module docstring). Restores the original allocators on exit; nesting is harmless."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in _TARGETS]
    try:
        for owner, name, alloc in saved:
            if not hasattr(alloc, "__wrapped_allocator__"):
                setattr(owner, name, _poisoning(alloc))
        yield
    finally:
        for owner, name, alloc in saved:
            setattr(owner, name, alloc)
