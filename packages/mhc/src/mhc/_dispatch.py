"""The one place that picks the mHC backend: ``"triton"`` or ``"reference"``.

``backend="auto"`` means: the environment variable ``MHC_BACKEND`` if set (``auto``/``triton``/``reference``), else
Triton when every tensor is on CUDA and the fp32 PyTorch reference otherwise. An explicit ``"triton"`` on CPU tensors
works only under the Triton interpreter (``TRITON_INTERPRET=1``, set by the testkit on CPU machines).
"""

from __future__ import annotations

import os

import torch

ENV_VAR = "MHC_BACKEND"
BACKENDS = ("auto", "triton", "reference")


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """Return ``"triton"`` or ``"reference"`` for ``backend`` and the tensors the op will run on."""
    if backend not in BACKENDS:
        raise ValueError(f"mhc backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"environment variable {ENV_VAR}={backend!r} must be one of {BACKENDS}")
    if backend == "auto":
        return "triton" if tensors and all(t.is_cuda for t in tensors) else "reference"
    if backend == "triton":
        interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
        for t in tensors:
            if not (t.is_cuda or (t.device.type == "cpu" and interp)):
                raise ValueError(
                    f"mhc Triton backend needs CUDA tensors (got {t.device}); use backend='reference' on CPU, "
                    "or set TRITON_INTERPRET=1 before importing mhc to run the kernels in the interpreter"
                )
    return backend
