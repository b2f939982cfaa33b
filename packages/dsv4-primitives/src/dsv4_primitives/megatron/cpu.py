"""Running megatron-core 0.19.2's ``transformer_impl="local"`` path on a machine without CUDA.

megatron-core assumes CUDA in a few places even on its local (non-transformer-engine) path. Each shim below names
the assumption it neutralises; all are no-ops when CUDA is available. They are used by ``dsv4 train`` on CPU and by
the test fixtures in ``dsv4-testkit``.

1. ``torch.cuda.current_device()`` is called at ~200 sites (``GlobalMemoryBuffer.get_tensor``, ``RotaryEmbedding``,
   buffers of the distributed optimizer, ...): on CPU it is redirected to return ``"cpu"``. This is a process-wide
   patch of ``torch.cuda``, so it is applied only by an explicit call: :func:`apply_cpu_shims` (for the rest of the
   process, e.g. ``dsv4 train`` on CPU; :func:`remove_cpu_shims` undoes it) or the :func:`cpu_shims` context
   (for a block, e.g. the testkit's megatron fixture); :func:`cuda_as_cpu` also patches it for its own duration.
   Importing this module changes nothing.
2. ``model_parallel_cuda_manual_seed`` needs a CUDA driver, and without it ``get_cuda_rng_tracker().fork()`` raises
   "cuda rng state model-parallel-rng is not added": the tracker is initialised in its inference mode, whose
   ``fork()`` is a null context (dropout then draws from the default CPU generator).
3. megatron-core's optimizers (``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``, ``clip_grads``)
   and pipeline schedules (``total_num_tokens = torch.zeros(..., device="cuda")`` in all three
   ``forward_backward_*`` functions) create tensors with ``device='cuda'``, call ``.cuda()`` on state, and
   classify params by ``param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']`` /
   ``== 'torch.cuda.FloatTensor'``. :func:`cuda_as_cpu` is a ``TorchFunctionMode`` that, while active and only
   without CUDA, maps ``device='cuda'`` (factory functions and ``Tensor.to``) to the CPU, makes ``Tensor.cuda()`` a
   no-op and reports CPU tensors' ``Tensor.type()`` with the ``torch.cuda.`` prefix megatron expects. Wrap
   optimizer construction, ``step()``, ``get_forward_backward_func()(...)`` calls and checkpoint save/load in it on
   CPU. Nothing else about tensor behaviour changes.
4. ``_ParamAndGradBucketGroup.start_grad_sync`` (DDP) calls ``torch.cuda.current_stream()`` to wait for CUDA-graph
   events, and dist-checkpointing's ``FileSystemWriterAsync.preload_tensors`` calls ``torch.cuda.synchronize()``;
   inside :func:`cuda_as_cpu` the first returns a CPU stand-in whose ``wait_event``/``wait_stream``/
   ``synchronize`` do nothing and the second does nothing (CPU work is synchronous). Both are restored on exit.

Not CPU-specific: megatron-core 0.19.2's dist-checkpointing *save* calls ``psutil``, which megatron-core does not
declare; dsv4-primitives declares it as a dependency.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_original_current_device = None  # the real torch.cuda.current_device while shim 1 is applied, else None


def _cpu_current_device() -> str:
    return "cpu"


def cpu_shims_applied() -> bool:
    """Whether shim 1 (``torch.cuda.current_device() == "cpu"``) is in place."""
    return _original_current_device is not None


def apply_cpu_shims() -> bool:
    """Neutralise megatron-core's CUDA assumptions when no CUDA device exists (shim 1, process-wide, idempotent).

    Returns whether this call applied it (False with CUDA or when it is already applied).
    """
    global _original_current_device
    if torch.cuda.is_available() or cpu_shims_applied():
        return False
    _original_current_device = torch.cuda.current_device
    torch.cuda.current_device = _cpu_current_device  # shim 1
    return True


def remove_cpu_shims() -> None:
    """Undo :func:`apply_cpu_shims` (a no-op when it is not applied)."""
    global _original_current_device
    if cpu_shims_applied():
        torch.cuda.current_device = _original_current_device
        _original_current_device = None


@contextlib.contextmanager
def cpu_shims():
    """Shim 1 for the duration of the block (restored on exit unless it was applied before the block)."""
    applied = apply_cpu_shims()
    try:
        yield
    finally:
        if applied:
            remove_cpu_shims()


def init_rng_tracker(seed: int = 1234, *, cuda_graph_safe: bool = False) -> None:
    """Seed megatron-core's RNG tracker: the real CUDA tracker on GPU, the null-fork tracker on CPU (shim 2).

    ``cuda_graph_safe``: the tracker keeps its streams as graph-safe generators (megatron's
    ``use_cudagraphable_rng``), which megatron's ``FullCudaGraphWrapper`` registers with every captured graph; it
    refuses the default tensor states ("expected a Generator, but got Tensor"). GPU only; ignored on CPU.
    """
    from megatron.core.tensor_parallel.random import initialize_rng_tracker, model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cuda_graph_safe, force_reset_rng=True)
    else:
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.split(":")[0] == "cuda"
    return False


class _CudaAsCpuMode(TorchFunctionMode):
    """Shim 3 (see the module docstring): ``cuda`` placements become CPU ones; CPU ``type()`` names look CUDA."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda_device(a) else a for a in args)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if (
                args[0].device.type == "cpu"
                and name.startswith("torch.")
                and not name.startswith("torch.cuda.")
            ):
                return "torch.cuda." + name[len("torch.") :]
            return name
        return func(*args, **kwargs)


class _CpuStream:
    """What ``torch.cuda.current_stream()`` returns inside :func:`cuda_as_cpu` (shim 4): CPU work is synchronous."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def cuda_as_cpu():
    """Run megatron-core DDP/optimizer code on CPU tensors (shims 1, 3 and 4, all restored on exit unless shim 1 was
    applied before); a null context with CUDA."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_stream, torch.cuda.synchronize
    torch.cuda.current_stream = lambda device=None: _CpuStream()
    torch.cuda.synchronize = lambda device=None: None
    try:
        with cpu_shims(), _CudaAsCpuMode():
            yield
    finally:
        torch.cuda.current_stream, torch.cuda.synchronize = saved
