"""Run or build high-precision submodules with FP8/FP4 disabled inside an FP8 model (P1).

transformer-engine is optional and is imported only when this helper is called with FP8/FP4 active in the config;
without it, or with FP8/FP4 off, the helper is a null context.
"""

from __future__ import annotations

import contextlib


def _te_pytorch():
    try:
        import transformer_engine.pytorch as te
    except ImportError:
        return None
    return te


def fp8_disabled_context(config, is_init: bool = False) -> contextlib.AbstractContextManager:
    """A context that disables FP8/FP4 for the enclosed modules.

    Args:
        config: a megatron ``TransformerConfig`` (read: ``fp8``, ``fp4``, ``fp8_param``, ``fp4_param``).
        is_init: building modules (``te.fp8_model_init(enabled=False)`` when FP8/FP4 *parameters* are on) rather
            than running them (``te.fp8_autocast(enabled=False)`` when FP8/FP4 compute is on).
    Returns:
        The transformer-engine context, or ``contextlib.nullcontext()`` when nothing is to be disabled or
        transformer-engine is not installed (then nothing can be FP8 in the first place).
    """
    fp8 = bool(getattr(config, "fp8", None)) or bool(getattr(config, "fp4", None))
    fp8_param = bool(getattr(config, "fp8_param", False)) or bool(getattr(config, "fp4_param", False))
    wanted = fp8_param if is_init else fp8
    if not wanted:
        return contextlib.nullcontext()
    te = _te_pytorch()
    if te is None:
        return contextlib.nullcontext()
    if is_init:
        return te.fp8_model_init(enabled=False)
    return te.fp8_autocast(enabled=False)
