"""Bytes held by live tensors: what survives a training step (issue 33).

On CUDA this is ``torch.cuda.memory_allocated``. On CPU, where no allocator counts for us, it is the sum of the
distinct storages of every tensor Python can reach (the garbage collector's objects): parameters, gradients,
optimizer state and whatever a module, a megatron token dispatcher or a cache still holds after the step. Tensors
only C++ holds without ever having had a Python object (an autograd node's saved tensors) are not counted on CPU; a
graph kept alive through a Python-visible tensor still shows through its leaves.
"""

from __future__ import annotations

import gc
from collections import Counter

import torch


def live_tensor_bytes(device: torch.device | str = "cpu") -> int:
    """Bytes of live tensor storage on ``device`` after a garbage collection (CUDA: the caching allocator's
    allocated bytes; CPU: distinct storages of every Python-reachable tensor)."""
    device = torch.device(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == device.type and obj.layout == torch.strided:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def live_tensor_census(device: torch.device | str = "cpu") -> Counter:
    """Bytes of the Python-reachable tensors on ``device`` by ``(shape, dtype, holder)``, where ``holder`` is
    ``"parameter"``, ``"grad"`` or ``"other"`` (a diagnosis aid: which tensors make up :func:`live_tensor_bytes`;
    tensors viewing one storage each count their own bytes)."""
    device = torch.device(device)
    gc.collect()
    census: Counter = Counter()
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == device.type and obj.layout == torch.strided:
            holder = "parameter" if isinstance(obj, torch.nn.Parameter) else "other"
            census[(tuple(obj.shape), str(obj.dtype).removeprefix("torch."), holder)] += (
                obj.numel() * obj.element_size()
            )
    return census


def census_growth(short: Counter, long: Counter, short_len: int, long_len: int, top: int = 8) -> str:
    """The ``top`` entries whose bytes grew most from the ``short_len`` census to the ``long_len`` one, one line
    each, shapes with a dimension that is a multiple of the length written ``k·S``."""

    def per_len(census: Counter, n: int) -> Counter:
        out: Counter = Counter()
        for (shape, dtype, holder), b in census.items():
            dims = tuple(f"{d // n}S" if d >= n and d % n == 0 else str(d) for d in shape)
            out[(dims, dtype, holder)] += b
        return out

    a, b = per_len(short, short_len), per_len(long, long_len)
    grown = sorted(((b[k] - a[k], k) for k in set(a) | set(b)), reverse=True)[:top]
    return "; ".join(f"[{', '.join(k[0])}] {k[1]} {k[2]}: +{d} B" for d, k in grown if d > 0)
