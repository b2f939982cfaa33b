"""Host ints -> device tensors without a host <-> device sync: cached, CUDA-graph-capture-safe, read-only constants."""

from __future__ import annotations

from collections import OrderedDict

import torch


def upload_host_ints(values: list, device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Host ints (nested lists allowed) -> a tensor on ``device`` without a host <-> device sync.

    On CUDA the result is a read-only constant shared by every call with the same values (a bounded cache; the
    callers pass host bounds of layouts, which repeat step after step): the first call copies non-blocking (a
    pageable source is staged by the driver before the call returns), later calls copy nothing. That also makes the
    callers capturable in a CUDA graph: inside a capture a cache miss copies from a pinned buffer that is kept, with
    the device tensor, for the life of the process (the graph re-reads it at every replay), and an entry created or
    used during a capture is never evicted. Do not modify the returned tensor in place.
    """
    device = None if device is None else torch.device(device)
    if device is None or device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return _DEVICE_INTS.get(values, dtype, device)


def _frozen(values) -> tuple:
    """Nested lists of ints as nested tuples (a hashable key that also encodes the shape)."""
    return tuple(_frozen(v) if isinstance(v, (list, tuple)) else int(v) for v in values)


class _DeviceIntCache:
    """LRU cache ``(device, dtype, nested values) -> device tensor`` for :func:`upload_host_ints` (the host tensor is
    built only on a miss).

    Entries are never inference tensors (built outside ``torch.inference_mode``: autograd Functions save them for
    backward in a later training step). An entry created during a CUDA-graph capture holds its pinned source; its
    device copy exists only in the graph, so the first use outside a capture copies it eagerly too (an aborted
    capture leaves no unfilled tensor behind).
    """

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        # used in a graph capture: (device tensor, pinned source or None, filled outside a capture)
        self.kept: dict[tuple, list] = {}

    def get(self, values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (device, dtype, _frozen(values))
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        kept = self.kept.get(key)
        if kept is not None:
            dev, pinned, filled = kept
            if not capturing and not filled:
                dev.copy_(pinned, non_blocking=True)
                kept[2] = True
            return dev
        hit = self.entries.get(key)
        if hit is not None:
            self.entries.move_to_end(key)
            if capturing:  # a captured graph now reads it: never evict
                self.kept[key] = [self.entries.pop(key), None, True]
            return hit
        with torch.inference_mode(False):
            host = torch.tensor(values, dtype=dtype)
            if capturing:
                pinned = host.pin_memory()
                dev = torch.empty(host.shape, dtype=dtype, device=device)
                dev.copy_(pinned, non_blocking=True)
                self.kept[key] = [dev, pinned, False]
                return dev
            dev = host.to(device, non_blocking=True, copy=True)
        self.entries[key] = dev
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
        return dev


_DEVICE_INTS = _DeviceIntCache()
