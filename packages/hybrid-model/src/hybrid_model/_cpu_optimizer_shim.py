"""CPU shim for megatron-core 0.19.2's optimizer, schedules and checkpoint savers (private; complements ``dsv4_primitives.megatron_cpu``).

``MegatronOptimizer.__init__``, the grad scaler, ``clip_grads``, the forward-backward schedules (token counters) and the dist-checkpoint
savers create small bookkeeping tensors with a
hard-coded ``device='cuda'`` (``found_inf``, ``_dummy_overflow_buf``, ``_scale_one``, the grad-norm accumulators).
On a machine without CUDA those modules' ``torch`` name is replaced by a proxy whose tensor factories map
``device='cuda'`` to the CPU and whose ``cuda.current_stream()`` is a no-op stream (the gradient
buffers wait on it before reducing); everything else is forwarded to ``torch`` unchanged. A no-op when CUDA exists.
"""

from __future__ import annotations

import contextlib
import importlib
import types

import torch

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "zeros_like", "ones_like", "empty_like")
_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",
)


def _cpu_device(kwargs: dict) -> dict:
    dev = kwargs.get("device")
    if dev is not None and str(dev).startswith("cuda"):
        kwargs = dict(kwargs, device="cpu")
    return kwargs


class _NullStream:
    """Stands for the current CUDA stream on CPU: waits are no-ops (CPU execution is synchronous)."""

    def wait_event(self, event) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None

    def synchronize(self) -> None:
        return None


class _CudaOnCpu(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("torch.cuda")

    def __getattr__(self, name: str):
        if name == "current_stream":
            return lambda *a, **k: _NullStream()
        if name == "synchronize":
            return lambda *a, **k: None
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaOnCpu()

    def __getattr__(self, name: str):
        attr = getattr(torch, name)
        if name in _FACTORIES:

            def factory(*args, **kwargs):
                return attr(*args, **_cpu_device(kwargs))

            return factory
        return attr


_applied = False


def _no_psutil_memory_probe() -> None:
    """megatron-core's async checkpoint writer logs its RSS through ``psutil``, which is not a dependency of this
    workspace; without ``psutil`` the probe reports 0 instead of failing the save (logging only)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not getattr(filesystem_async, "HAVE_PSUTIL", True):
        filesystem_async._process_memory = lambda: 0


def apply_optimizer_cpu_shims() -> None:
    """Redirect the optimizer modules' ``device='cuda'`` bookkeeping tensors to the CPU (idempotent)."""
    global _applied
    if _applied:
        return
    _no_psutil_memory_probe()
    if torch.cuda.is_available():
        _applied = True
        return
    proxy = _TorchOnCpu()
    for name in _MODULES:
        mod = importlib.import_module(name)
        if getattr(mod, "torch", None) is torch:
            mod.torch = proxy
    _applied = True


_CUDA_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def cuda_type_names():
    """Within the block, ``Tensor.type()`` (no arguments) reports CPU float tensors under their CUDA names.

    megatron-core's (distributed) optimizer dispatches on ``param.type() == 'torch.cuda.FloatTensor'`` when it
    builds its parameter groups and when it clips gradients; wrap those calls with this on a CPU-only machine.
    A no-op when CUDA exists.
    """
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.type

    def type_(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if not args and not kwargs:
            return _CUDA_NAMES.get(out, out)
        return out

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original
