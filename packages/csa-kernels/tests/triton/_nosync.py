"""CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``: fail on every op that reads tensor VALUES back
to the host (on CUDA each is a device -> host sync).

Caught: ``item`` / ``int()`` / ``float()`` / ``bool()`` (``aten._local_scalar_dense``), ``Tensor.tolist``,
``nonzero``, ``masked_select``, boolean-mask indexing, ``torch.equal``, ``unique``, ``repeat_interleave`` without
``output_size``. Not caught (no CPU equivalent): explicit ``.cpu()`` copies; the GPU tests cover those.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class HostReadError(AssertionError):
    """An op read device values on the host (a device -> host sync on CUDA)."""


_READS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
}


class _HostReadDetector(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS:
            raise HostReadError(f"{func} reads tensor values on the host")
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            raise HostReadError("repeat_interleave without output_size reads the repeats on the host")
        if func is aten.index.Tensor:
            for ix in args[1]:
                if ix is not None and ix.dtype in (torch.bool, torch.uint8):
                    raise HostReadError("boolean-mask indexing reads the mask on the host")
        return func(*args, **kwargs)


@contextmanager
def no_host_reads():
    """Raise :class:`HostReadError` on any host read of tensor values inside the block (forward and backward run
    inside it: CPU autograd runs on the calling thread)."""
    original = torch.Tensor.tolist

    def tolist(self):
        raise HostReadError("Tensor.tolist reads tensor values on the host")

    torch.Tensor.tolist = tolist
    try:
        with _HostReadDetector():
            yield
    finally:
        torch.Tensor.tolist = original
