"""Shared test helpers for the DSv4 workspace (dev only, never a runtime dependency).

Public API:

- :func:`assert_close_to_ref` / :func:`max_abs_err`: the tolerance rule (error at most 2x what plain PyTorch in the
  same dtype gets against the fp32 reference, plus a small atol).
- :func:`nan_poison` / :func:`assert_fully_written`: NaN poisoning of outputs that kernels must fully write;
  :func:`poison_allocations` (on for every test through the plugin): fresh ``torch.empty`` allocations are NaN.
- :func:`megatron_cpu_context` and the ``megatron_cpu`` pytest fixture: megatron-core 0.19.2 parallel state on
  CPU (gloo, world size 1) with its CUDA assumptions neutralised (see :mod:`dsv4_testkit.megatron_cpu`).
- :func:`run_distributed`: a gloo multi-process runner on loopback (world sizes 2, 4, ...).
- :data:`INTERPRET` / :func:`interpreting`: whether Triton runs under ``TRITON_INTERPRET=1``.
"""

from dsv4_testkit.distributed import free_port, run_distributed
from dsv4_testkit.megatron_cpu import megatron_cpu_context
from dsv4_testkit.poison import assert_fully_written, nan_poison, poison_allocations
from dsv4_testkit.tolerance import DEFAULT_ATOL, assert_close_to_ref, max_abs_err
from dsv4_testkit.triton_env import interpreting

__all__ = [
    "DEFAULT_ATOL",
    "assert_close_to_ref",
    "assert_fully_written",
    "free_port",
    "interpreting",
    "max_abs_err",
    "megatron_cpu_context",
    "nan_poison",
    "poison_allocations",
    "run_distributed",
]
__version__ = "0.3.2"
