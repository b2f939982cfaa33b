"""Selective FP32 (P1): mark tensors that must stay FP32 and convert a module to bf16/fp16 around them.

DSv4 keeps these in FP32 under ``--bf16``: attention sinks, compressor position biases (``ape``), every mHC
parameter, the router selection bias; the hash routing table is integer and is never cast anyway. A tensor is
marked by setting the attribute ``keep_in_fp32 = True`` on it (the same attribute upstream megatron-core uses after
P1, so modules marked here keep working with a later megatron-core).

The mark lives on the tensor object. Parameters keep their object through dtype/device conversions (only ``.data``
is replaced), buffers do not: ``nn.Module._apply`` (``.to(device)``, ``.cuda()``, ``.bfloat16()``, ...) puts new
buffer tensors in place, without the mark. Two ways to convert a model while keeping marked tensors FP32:

- :func:`convert_module_to_dtype_except_fp32_marked` (what ``Float16ModuleKeepFP32`` uses) casts a whole module
  tree in one call;
- modules that own marked tensors inherit :class:`KeepFP32Mixin`: then plain ``module.bfloat16()`` / ``.half()`` /
  ``.to(...)`` (what megatron-core 0.19.2's ``Float16Module`` and user code call) keep them FP32 too, and buffer
  marks survive device moves (the mixin marks the new buffer tensors again).
"""

from __future__ import annotations

import torch
from torch import nn

KEEP_IN_FP32_ATTR = "keep_in_fp32"


def mark_keep_in_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` (a parameter or buffer) to stay FP32 under module dtype conversion; returns it.

    Raises:
        ValueError: ``tensor`` is not a floating-point tensor (integer tables are never cast, so need no mark).
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"mark_keep_in_fp32 expects a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.dtype.is_floating_point:
        raise ValueError(
            f"mark_keep_in_fp32: {tensor.dtype} tensors are never cast by module conversion; only mark floating "
            "tensors"
        )
    setattr(tensor, KEEP_IN_FP32_ATTR, True)
    return tensor


def is_keep_in_fp32(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` carries the keep-in-FP32 mark."""
    return bool(getattr(tensor, KEEP_IN_FP32_ATTR, False))


def _target_dtype(t: torch.Tensor, dtype: torch.dtype, marked: bool) -> torch.dtype:
    if not t.dtype.is_floating_point:
        return t.dtype
    return torch.float32 if marked else dtype


@torch.no_grad()
def convert_module_to_dtype_except_fp32_marked(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast every floating parameter, gradient and buffer of ``module`` to ``dtype`` except marked ones (in place).

    Marked tensors end up FP32 (a marked tensor that is not FP32 is upcast). Integer/bool tensors are untouched.
    Parameters keep their identity (``param.data`` is replaced, so optimizer references and marks survive).
    Returns ``module``.
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
    for mod in module.modules():
        for p in mod._parameters.values():
            if p is None:
                continue
            target = _target_dtype(p, dtype, is_keep_in_fp32(p))
            if p.dtype != target:
                p.data = p.data.to(target)  # the Parameter object (and its mark) survives
            if p.grad is not None and p.grad.dtype != target:
                p.grad = p.grad.to(target)
        for name, b in mod._buffers.items():
            if b is None:
                continue
            target = _target_dtype(b, dtype, is_keep_in_fp32(b))
            if b.dtype != target:
                new = b.to(target)
                if is_keep_in_fp32(b):
                    mark_keep_in_fp32(new)
                mod._buffers[name] = new
    return module


class KeepFP32Mixin:
    """Mixin for ``nn.Module`` subclasses owning marked tensors: they stay FP32 (and marked) through ``_apply``.

    Every module conversion (``.to(dtype/device)``, ``.bfloat16()``, ``.half()``, ``.cuda()``, ``.cpu()``) goes
    through ``nn.Module._apply``, which casts every floating tensor and replaces buffer tensors. For the module's own
    marked FP32 parameters and buffers, the mixin puts the original FP32 values back after a cast (moved to the new
    device; a parameter keeps its identity and its gradient stays FP32) and marks replaced tensors again, so buffer
    marks survive device moves. Children are handled by their own ``_apply``: each module class that owns marked
    tensors inherits the mixin, listed before the ``nn.Module`` base::

        class CompressedSparseAttention(KeepFP32Mixin, MegatronModule): ...
    """

    def _apply(self, fn, recurse=True):
        params = {  # .data aliases: _apply swaps the storage of the param and grad objects in place
            name: (p.data, None if p.grad is None else p.grad.data)
            for name, p in self._parameters.items()
            if p is not None and is_keep_in_fp32(p) and p.dtype == torch.float32
        }
        buffers = {
            name: b
            for name, b in self._buffers.items()
            if b is not None and is_keep_in_fp32(b) and b.dtype == torch.float32
        }
        module = super()._apply(fn, recurse)
        for name, (data, grad) in params.items():
            p = self._parameters[name]
            if (
                p.dtype != torch.float32
            ):  # the cast was lossy: put the original values back, on the new device
                p.data = data.to(device=p.device)
                if p.grad is not None:
                    p.grad = grad.to(device=p.device) if grad is not None else p.grad.float()
            mark_keep_in_fp32(p)  # a new Parameter object (overwrite_module_params_on_conversion) has no mark
        for name, old in buffers.items():
            new = self._buffers[name]
            if new.dtype != torch.float32:
                new = old.to(device=new.device)
                self._buffers[name] = new
            mark_keep_in_fp32(new)
        return module
