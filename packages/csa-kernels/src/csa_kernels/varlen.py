"""Packed-layout (THD, flash-attn varlen) helpers: compressed ``cu_seqlens``, SBHD <-> THD, document ids.

Convention: ``cu_seqlens`` int32 ``[N+1]`` (empty documents allowed); document ``i`` owns packed rows
``cu_seqlens[i] .. cu_seqlens[i+1]-1`` and positions restart at 0 in every document. Each document is compressed
independently: it yields ``floor(len_i / ratio)`` entries, stored contiguously in ``cu_seqlens_c`` order.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import torch

from csa_kernels._checks import _check_cu_values, check_cu_seqlens, check_host_cu_seqlens, check_ratio


def compressed_cu_seqlens(
    cu_seqlens: torch.Tensor, ratio: int, *, cu_seqlens_host: list[int] | None = None
) -> torch.Tensor:
    """``cu_seqlens_c`` int32 ``[N+1]`` with ``cu_seqlens_c[i+1] - cu_seqlens_c[i] = floor(len_i / ratio)``.

    ``cu_seqlens_host``: the caller's host copy of ``cu_seqlens`` (validation without a device sync).
    """
    check_ratio(ratio)
    check_cu_seqlens(cu_seqlens, host=cu_seqlens_host)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64) // ratio
    out = torch.zeros(cu_seqlens.numel(), dtype=torch.int32, device=cu_seqlens.device)
    out[1:] = torch.cumsum(lens, 0).to(torch.int32)
    return out


def compressed_cu_seqlens_host(cu_seqlens_host: list[int], ratio: int) -> list[int]:
    """Host form of :func:`compressed_cu_seqlens`: ``cu_seqlens_c`` as a list from the host list ``cu_seqlens``
    (pure Python, no tensor; what trusted callers pass as ``cu_seqlens_c_host``)."""
    check_ratio(ratio)
    cu = _check_cu_values(check_host_cu_seqlens(cu_seqlens_host), "cu_seqlens_host", None)
    out = [0]
    for a, b in itertools.pairwise(cu):
        out.append(out[-1] + (b - a) // ratio)
    return out


def sbhd_cu_seqlens_host(batch: int, seq_len: int) -> list[int]:
    """Host list ``[0, S, 2S, ..., B*S]`` (the host copy of :func:`sbhd_cu_seqlens`)."""
    if batch < 0 or seq_len < 0:
        raise ValueError(f"batch and seq_len must be >= 0, got {batch}, {seq_len}")
    return [b * seq_len for b in range(batch + 1)]


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


def sbhd_cu_seqlens(batch: int, seq_len: int, device=None) -> torch.Tensor:
    """``[0, S, 2S, ..., B*S]`` int32: the THD view of an SBHD batch of ``B`` sequences of length ``S``."""
    if batch < 0 or seq_len < 0:
        raise ValueError(f"batch and seq_len must be >= 0, got {batch}, {seq_len}")
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * seq_len


def sbhd_to_thd(x: torch.Tensor) -> torch.Tensor:
    """``[S, B, ...] -> [B*S, ...]`` with each sequence's rows contiguous (document ``b`` = rows ``b*S .. b*S+S-1``)."""
    return x.transpose(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def thd_to_sbhd(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of :func:`sbhd_to_thd`: ``[B*S, ...] -> [S, B, ...]``."""
    return x.reshape(batch, x.shape[0] // max(batch, 1), *x.shape[1:]).transpose(0, 1)


def document_ids(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """``[T]`` int64 document index of every packed row (``T = cu_seqlens[-1]``; pass it as ``total`` when known on
    the host: then no device sync)."""
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens, output_size=total)


def document_positions(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """``[T]`` int64 document-relative position of every packed row (``total`` as in :func:`document_ids`)."""
    cu = cu_seqlens.to(torch.int64)
    doc = document_ids(cu, total)
    return torch.arange(doc.numel(), device=cu.device) - cu[doc]


def cu_seqlens_from_lengths(lengths: list[int], device=None) -> torch.Tensor:
    """int32 ``[N+1]`` prefix sums of document lengths (zeros allowed: empty documents)."""
    if any((not isinstance(n, int)) or n < 0 for n in lengths):
        raise ValueError(f"lengths must be ints >= 0, got {lengths}")
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    return out.to(device)
