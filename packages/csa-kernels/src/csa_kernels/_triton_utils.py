"""Small helpers shared by the Triton kernels of this package (interpreter switch, block sizes, launch checks)."""

from __future__ import annotations

import functools
import os

import torch
import triton

from csa_kernels.determinism import deterministic_default


def interpreting() -> bool:
    """True when Triton runs in the CPU interpreter (``TRITON_INTERPRET=1``): kernels then upcast before ``tl.dot``."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``max(n, 1)``."""
    return triton.next_power_of_2(max(int(n), 1))


def check_triton_device(*tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor is on CUDA, or on CPU with the Triton interpreter switched on."""
    for t in tensors:
        if t.device.type == "cuda":
            continue
        if t.device.type == "cpu" and interpreting():
            continue
        raise ValueError(
            f"Triton backend needs CUDA tensors (got device {t.device}); on CPU use backend='reference' "
            "or set TRITON_INTERPRET=1 before importing csa_kernels to run the kernels in the interpreter"
        )


def resolve_deterministic(flag: bool | None) -> bool:
    """The ``deterministic`` switch of the backward kernels: an explicit ``True`` / ``False`` wins; ``None`` is the
    process-wide default (:func:`csa_kernels.determinism.deterministic_default`, ``True`` unless
    :func:`~csa_kernels.determinism.set_deterministic_default` changed it), forced on by
    ``torch.are_deterministic_algorithms_enabled()`` (``torch.use_deterministic_algorithms(True)``, which
    ``dsv4 train --deterministic`` sets)."""
    if flag is None:
        return deterministic_default() or torch.are_deterministic_algorithms_enabled()
    return bool(flag)


@functools.cache
def sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (one wave of one-CTA-per-SM programs)."""
    return torch.cuda.get_device_properties(index).multi_processor_count
