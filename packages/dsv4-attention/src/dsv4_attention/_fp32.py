"""Keep-in-FP32 parameters (attention sink, compressor ``ape``) under ``module.bfloat16()`` / ``.half()``.

Parameters are marked with ``dsv4_primitives.mark_keep_in_fp32`` (P1), which
``dsv4_primitives.convert_module_to_dtype_except_fp32_marked`` honours. megatron-core 0.19.2's ``Float16Module``
still calls ``module.bfloat16()``,
which casts every floating tensor; :class:`KeepFP32Mixin` therefore restores marked parameters (and their grads)
of the owning module to fp32 after any ``_apply`` (``.to``, ``.bfloat16()``, ``.half()``, ``.cuda()``).
"""

from __future__ import annotations

import torch

from dsv4_primitives import mark_keep_in_fp32

__all__ = ["KeepFP32Mixin", "mark_keep_in_fp32"]


class KeepFP32Mixin:
    """Mixin for ``nn.Module`` subclasses owning parameters marked ``keep_in_fp32``."""

    def _apply(self, fn, recurse=True):
        kept = {
            name: (p.data, p.grad)
            for name, p in self._parameters.items()
            if p is not None and getattr(p, "keep_in_fp32", False) and p.dtype == torch.float32
        }
        module = super()._apply(fn, recurse)
        for name, (data, grad) in kept.items():
            p = self._parameters[name]
            if p.dtype != torch.float32:
                # the cast was lossy: put the original fp32 values back, on the new device
                p.data = data.to(device=p.device)
                if p.grad is not None:
                    p.grad = grad.to(device=p.device) if grad is not None else p.grad.float()
        return module
