"""A CPU-only stand-in for the GPU/host split of megatron-core's ``HybridDeviceOptimizer`` (test helper).

megatron's hybrid optimizer decides what to offload by ``param.is_cuda`` and makes host copies with
``.cpu().pin_memory()``; on a machine without CUDA every tensor is a CPU tensor, so it would offload nothing and
then fail. :class:`SimulatedDevice` is a ``TorchFunctionMode`` under which CPU tensors play the GPU: ``is_cuda`` is
``True`` except for "host" tensors, which are the results of ``pin_memory()`` / ``pin_memory=True`` factories and
everything computed from a host tensor. ``pin_memory`` itself is a no-op on the data. So the real offload path runs
(host copies of the shards, host Adam state, gradient D2H copies into pinned buffers, the copy-back hooks), with
the arithmetic of the real thing (torch's fused CPU AdamW on the host side, torch AdamW on the "GPU" side).
"""

import contextlib
import weakref

import torch
from torch.overrides import TorchFunctionMode

_IS_CUDA = torch.Tensor.is_cuda  # the getset descriptor; modes see its __get__


class SimulatedDevice(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self._host = {}  # id -> weakref of the host tensors (a WeakSet would compare tensors with ==)

    def is_host(self, t) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _add_host(self, t) -> None:
        self._host[id(t)] = weakref.ref(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if getattr(func, "__self__", None) is _IS_CUDA:
            return not self.is_host(args[0])
        if func is torch.Tensor.pin_memory:
            self._add_host(args[0])
            return args[0]
        pinned = kwargs.pop("pin_memory", False)
        out = func(*args, **kwargs)
        inputs = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
        if torch.is_tensor(out) and (pinned or any(self.is_host(a) for a in inputs)):
            self._add_host(out)
        return out


class _Event:
    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


class _Stream:
    """CPU work is synchronous: streams and events order nothing."""

    def record_event(self, event=None):
        return _Event()

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def simulated_device():
    """:class:`SimulatedDevice` plus stand-ins for the CUDA streams/events megatron's hybrid optimizer orders its
    copies with (use inside ``cuda_as_cpu()``); yields the mode (``mode.is_host(t)``)."""
    saved = torch.cuda.current_stream, torch.cuda.stream, torch.cuda.Stream
    torch.cuda.current_stream = lambda device=None: _Stream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.Stream = _Stream
    try:
        with SimulatedDevice() as mode:
            yield mode
    finally:
        torch.cuda.current_stream, torch.cuda.stream, torch.cuda.Stream = saved
