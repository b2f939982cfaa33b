"""Dot precision of the coefficient GEMMs (``x @ fn.T`` forward, ``dmix @ fn`` and ``dmixᵀ X`` backward).

The spec keeps the coefficient math in fp32. A plain fp32 ``tl.dot`` (``ieee``) runs on CUDA cores and makes the
bandwidth-bound op compute-bound; the choices, via the environment variable ``MHC_DOT_PRECISION``:

==============  ==============================================================================================
``bf16split``   default. bf16 streams are exact in bf16, so the fp32 operand (``fn`` forward, ``rstd·dmix`` for
                ``dfn``) is split into three bf16 terms (8 significant bits each, 24 in all): three bf16
                tensor-core dots, exact products, fp32 accumulation = fp32-dot accuracy. fp32·fp32 dots
                (``dmix @ fn``) and fp32 streams use ``tf32x3``.
``tf32x3``      Triton's 3xTF32 for every dot (split both operands into big + small TF32, three TF32 dots):
                ~fp32 accuracy on tensor cores at half the bf16 rate.
``tf32``        one TF32 dot (10-bit mantissa inputs): fastest, ~1e-3 relative error in ``mix``; not fp32-grade.
``ieee``        exact fp32 FMA dot on CUDA cores: the accuracy yardstick, slow on GPU.
==============  ==============================================================================================

Under the Triton interpreter every dot is an fp32 dot (``ieee``); ``bf16split`` still splits (exercising the
split arithmetic on CPU when the streams are bf16).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

ENV = "MHC_DOT_PRECISION"
MODES = ("bf16split", "tf32x3", "tf32", "ieee")
DEFAULT = "bf16split"


@dataclass(frozen=True)
class DotPlan:
    """Kernel constexprs: ``fwd_split`` (0/1) and ``dfn_split`` (0/2) select ``_mm``'s bf16 split, ``prec`` the
    ``input_precision`` of fp32·fp32 dots."""

    fwd_split: int
    dfn_split: int
    prec: str


def dot_mode() -> str:
    """The active mode (``MHC_DOT_PRECISION``, default ``bf16split``)."""
    mode = os.environ.get(ENV, DEFAULT).strip().lower() or DEFAULT
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r} is not a dot precision; use one of {', '.join(MODES)}")
    return mode


def dot_plan(stream_dtype: torch.dtype, interpreting: bool) -> DotPlan:
    """Constexprs for streams of ``stream_dtype`` under the active mode."""
    mode = dot_mode()
    split = mode == "bf16split" and stream_dtype == torch.bfloat16
    if interpreting or mode == "ieee":
        prec = "ieee"
    elif mode == "tf32":
        prec = "tf32"
    else:
        prec = "tf32x3"
    return DotPlan(fwd_split=1 if split else 0, dfn_split=2 if split else 0, prec=prec)
