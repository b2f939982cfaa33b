"""Backend selection shared by the dispatching ops of dsv4-primitives (``apply_rope``, ``rms_norm``).

``backend="auto"`` means: the environment variable ``DSV4_PRIMITIVES_BACKEND`` if set (``auto`` / ``triton`` /
``reference``), else the fused Triton kernel when the input lives on CUDA and the eager PyTorch path otherwise. An
explicit ``backend=`` argument always wins over the variable. ``"triton"`` on CPU tensors runs the kernel in the
Triton interpreter and therefore needs ``TRITON_INTERPRET=1`` set before the kernel modules are imported (the
testkit's pytest plugin does this on machines without CUDA). ``"torch"`` is accepted as a synonym of
``"reference"`` (``apply_rope``'s historical name for its eager path).
"""

from __future__ import annotations

import os

import torch

ENV_VAR = "DSV4_PRIMITIVES_BACKEND"
BACKENDS = ("auto", "triton", "reference", "torch")


def triton_usable(x: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on ``x``: a CUDA tensor, or any tensor under ``TRITON_INTERPRET=1``."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, x: torch.Tensor, op: str) -> str:
    """Return ``"triton"`` or ``"reference"`` for ``op`` called with ``backend`` on ``x``.

    Raises:
        ValueError: ``backend`` or the environment variable is not a known name, or ``"triton"`` was asked for a
            CPU tensor outside the interpreter.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")
    explicit = backend != "auto"
    if not explicit:
        backend = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"environment variable {ENV_VAR}={backend!r} must be one of {BACKENDS}")
    if backend == "torch":
        backend = "reference"
    if backend == "auto":
        return "triton" if x.is_cuda else "reference"
    if backend == "triton" and not triton_usable(x):
        source = "backend='triton'" if explicit else f"{ENV_VAR}=triton"
        raise ValueError(
            f"{op}: {source} needs a CUDA tensor (or TRITON_INTERPRET=1 set before import for CPU tensors), got "
            f"a tensor on {x.device}; use backend='reference' on CPU"
        )
    return backend
