"""Compatibility shim of the former backend resolver of dsv4-primitives: the rule lives in
:mod:`dsv4_primitives.dispatch` (one resolver for every package). Kept for the ops that still import it."""

from __future__ import annotations

import torch

from dsv4_primitives.dispatch import resolve_backend as _resolve
from dsv4_primitives.dispatch import triton_usable as triton_usable

ENV_VAR = "DSV4_PRIMITIVES_BACKEND"
BACKENDS = ("auto", "triton", "reference", "torch")


def resolve_backend(backend: str, x: torch.Tensor, op: str) -> str:
    """``dsv4_primitives.dispatch.resolve_backend`` for the op ``dsv4_primitives.<op>`` (``"torch"`` = reference)."""
    return _resolve(backend, x, op=f"dsv4_primitives.{op}", allow_torch_alias=True)
