"""``--offload-activations``: the tensors a micro-batch's forward saves for backward live in pinned host memory.

A ``torch.autograd.graph.saved_tensors_hooks`` pair around each micro-batch's forward (:meth:`ActivationOffload.
hooks`). Pack: a saved CUDA tensor of at least ``min_bytes`` that is contiguous and not a parameter is copied into a
pinned host buffer (non-blocking, on the current stream) and the device tensor is let go. Unpack: the buffer is
copied back to the device (non-blocking, current stream) when backward reads it. Everything else is kept as is.

Why no synchronisation is needed: both copies are enqueued on the stream of the kernels around them. The caching
allocator hands a released device block to a later kernel of the same stream only, so that kernel runs after the
copy out; the host buffer is read only by the copy back, which runs after the copy out; and PyTorch's pinned-memory
allocator does not reuse a host buffer before the non-blocking copies that used it finish. The values are the
device tensor's bit for bit, so training is unchanged (tested on the GPU against the same run without it).

Under ``--recompute-granularity full`` a forward saves little beyond each checkpointed chunk's input streams (fp32
``[s, b, n·d]``, 64 KiB per token per layer on flash-smoke; 0.5 GiB per 1K tokens on its 8 main sub-layers): they
move to the host, which is what makes long sequences fit. Without recompute every large activation moves (a lot of
PCIe traffic). Cost: the copies run on the compute stream (about 2 x the offloaded bytes over PCIe per step).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class _OnHost:
    """A saved tensor's pinned host copy and the device it came from."""

    host: torch.Tensor
    device: torch.device


class ActivationOffload:
    """Saved-tensor hooks that keep a forward's large saved activations on the host (module doc).

    Args:
        modules: the model chunks whose parameters must stay where they are (never copied).
        min_bytes: smaller saved tensors stay on the device (the copies' fixed cost outweighs them).
        device_type: the device whose tensors move (``"cuda"``; the host buffers are pinned). ``"cpu"`` copies
            CPU tensors into fresh host buffers the same way: the hooks' path through a model and megatron's
            recompute, testable on a machine without CUDA (it saves no memory).
    """

    def __init__(self, modules, *, min_bytes: int = 1 << 20, device_type: str = "cuda") -> None:
        self.min_bytes = min_bytes
        self.device_type = device_type
        self._parameters = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
        self.offloaded_bytes = 0  # since construction: what the pack hook copied to the host

    def _moves(self, t: torch.Tensor) -> bool:
        return (
            t.device.type == self.device_type
            and t.is_contiguous()
            and t.numel() * t.element_size() >= self.min_bytes
            and t.untyped_storage().data_ptr() not in self._parameters
        )

    def _pack(self, t: torch.Tensor):
        if not self._moves(t):
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.device_type == "cuda")
        host.copy_(t, non_blocking=True)
        self.offloaded_bytes += t.numel() * t.element_size()
        return _OnHost(host, t.device)

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, _OnHost):
            return packed.host.to(packed.device, non_blocking=True)
        return packed

    def hooks(self) -> contextlib.AbstractContextManager:
        """The context to run a forward in: what it saves for backward goes through the hooks."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
