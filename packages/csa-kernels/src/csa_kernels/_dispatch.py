"""Backend selection for the public csa-kernels ops: ``backend="auto" | "triton" | "reference"``.

``auto`` picks the fused Triton kernels when the inputs live on CUDA and the fp32 PyTorch reference otherwise
(the reference stays the default on CPU). The environment variable ``CSA_KERNELS_BACKEND`` (``triton`` or
``reference``) overrides ``auto``; an explicit ``backend=`` argument always wins. ``triton`` on CPU tensors runs
the kernels in the Triton interpreter and therefore needs ``TRITON_INTERPRET=1`` set before import.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "reference")
ENV_VAR = "CSA_KERNELS_BACKEND"


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """Return ``"triton"`` or ``"reference"`` for an op called with ``backend`` on ``tensors``.

    Raises:
        ValueError: ``backend`` (or the environment variable) is not one of the known names.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if env and env != "auto":
        if env not in ("triton", "reference"):
            raise ValueError(f"{ENV_VAR} must be 'auto', 'triton' or 'reference', got {env!r}")
        return env
    on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors)
    return "triton" if on_cuda else "reference"
