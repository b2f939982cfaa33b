"""Bit-reproducible CPU training: PyTorch's deterministic kernels for the lifetime of a CPU run.

With more than one intra-op thread, PyTorch's CPU ``index_put_(..., accumulate=True)`` on float tensors of at least
``GRAIN_SIZE`` (32768) elements adds with parallel atomics, so the summation order changes from run to run. That
op is the backward of every advanced-indexing gather ``x[idx]``, e.g. the ``kv[indices]`` gather of the sparse /
window attention reference (csa-kernels) that a CPU run uses: two ``--packed`` runs with the same seed (and a
resumed run against an uninterrupted one) drifted apart in the last bits after a few steps. In deterministic mode
PyTorch runs that accumulation serially (and picks the deterministic implementation of every other op that has
one), which makes CPU runs bit-identical at any thread count.

GPU runs are left as they are (their kernels have their own determinism story; see the CUDA-graph module).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def use_deterministic_cpu_kernels(device: torch.device) -> Callable[[], None]:
    """On a CPU ``device``: switch PyTorch to deterministic algorithms (``warn_only``: an op without a
    deterministic implementation warns instead of failing the run; uninitialised memory is not filled, as before).
    Returns the function that restores the previous settings (a no-op for other devices)."""
    if device.type != "cpu":
        return lambda: None
    import torch.utils.deterministic as det

    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        det.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = False

    def restore() -> None:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        det.fill_uninitialized_memory = previous[2]

    return restore


__all__ = ["use_deterministic_cpu_kernels"]
