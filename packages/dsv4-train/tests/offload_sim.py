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


def dp_rank_offload_vs_fused(rank: int, world_size: int, fraction: float, chunk: int | None = None) -> dict:
    """One gloo rank of ``test_optimizer_offload.test_dp2_offload`` (and, with ``chunk``, the pipelined host step's
    ``test_offload_pipeline.test_dp2_pipeline``): the same steps with the non-offloaded fused optimizer and with the
    offload (simulated device), both DP-sharded; returns both runs' params and this rank's shard sizes."""
    from megatron.core import parallel_state as ps
    from test_optimizer_impl import _core, _step
    from test_optimizer_offload import _build, _model_params

    from dsv4_primitives.megatron import apply_cpu_shims, cuda_as_cpu, init_rng_tracker
    from dsv4_train.offload import hybrid_optimizers, offloaded_numel

    apply_cpu_shims()
    ps.initialize_model_parallel(1, 1)
    init_rng_tracker(0)
    with cuda_as_cpu():
        ddp0, ref = _build(False)
        for s in range(3):
            _step(ddp0, ref, s + rank)  # different gradients per rank: the DP average is what is applied
        with simulated_device():
            ddp1, opt = _build(True, fraction=fraction, offload_chunk_numel=chunk)
            for s in range(3):
                _step(ddp1, opt, s + rank)
    numel = sum(p.numel() for p in _core(ddp1).parameters())
    pipelined = [hdo.pipeline is not None for hdo in hybrid_optimizers(opt)]
    return {
        "pipelined": pipelined,
        "ref": _model_params(ddp0),
        "offload": _model_params(ddp1),
        "shard": offloaded_numel(opt),
        "numel": numel,
    }
