"""Bytes held by live tensors: what survives a training step (issue 33).

On CUDA this is ``torch.cuda.memory_allocated``. On CPU, where no allocator counts for us, it is the sum of the
distinct storages of every tensor Python can reach (the garbage collector's objects): parameters, gradients,
optimizer state and whatever a module, a megatron token dispatcher or a cache still holds after the step. Tensors
only C++ holds without ever having had a Python object (an autograd node's saved tensors) are not counted on CPU; a
graph kept alive through a Python-visible tensor still shows through its leaves.
"""

from __future__ import annotations

import gc

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
