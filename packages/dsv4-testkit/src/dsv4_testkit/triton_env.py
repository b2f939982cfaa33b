"""Triton interpreter switch: on a machine without CUDA, kernels run under ``TRITON_INTERPRET=1``.

``triton.jit`` reads the variable when a kernel is decorated, so :func:`ensure_interpreter_if_no_cuda` must run
before any kernel module is imported. The pytest plugin (:mod:`dsv4_testkit.plugin`) calls it at start-up.
"""

import os


def ensure_interpreter_if_no_cuda() -> None:
    """Set ``TRITON_INTERPRET=1`` when no CUDA device is present (idempotent; an explicit value wins)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
