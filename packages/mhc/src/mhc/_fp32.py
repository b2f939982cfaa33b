"""Keep-in-FP32 parameters (P1 convention) for every ``hc_*`` parameter.

Parameters are marked with ``dsv4_primitives.mark_keep_in_fp32`` when that helper exists (P1 runtime), else with
the same ``.keep_in_fp32 = True`` attribute it sets. megatron-core 0.19.2's ``Float16Module`` still calls
``module.bfloat16()``, which casts every floating tensor, so :class:`KeepFP32Mixin` restores marked parameters of
the owning module to their fp32 values after any ``_apply`` (``.to``, ``.bfloat16()``, ``.half()``, ``.cuda()``).
"""

from __future__ import annotations

import torch


def mark_keep_in_fp32(param: torch.Tensor) -> torch.Tensor:
    """Mark ``param`` as keep-in-FP32 and return it."""
    try:
        from dsv4_primitives import mark_keep_in_fp32 as _mark
    except ImportError:  # P1 runtime not there yet: set the attribute it would set
        _mark = None
    if _mark is not None:
        return _mark(param)
    param.keep_in_fp32 = True
    return param


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
