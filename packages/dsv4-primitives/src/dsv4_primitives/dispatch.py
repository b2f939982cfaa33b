"""Backend selection shared by every package's dispatching ops: ``backend="auto" | "triton" | "reference"``.

One rule for the whole workspace:

- an explicit ``backend="triton"`` or ``"reference"`` always wins;
- ``"auto"`` first reads the environment: the op's package variable ``<PACKAGE>_BACKEND`` (derived from the op's
  name: ``csa_kernels.sparse_attn`` -> ``CSA_KERNELS_BACKEND``; also ``DSV4_PRIMITIVES_BACKEND``, ``MHC_BACKEND``,
  ``HASH_MOE_BACKEND``), else the global ``DSV4_BACKEND``; a value of ``auto`` (or unset / empty) defers;
- otherwise ``"auto"`` is the fused Triton kernel when every input lives on CUDA (and, for ops that declare
  ``triton_dtypes``, has one of those dtypes) and the eager reference otherwise (so CPU runs the reference);
- ``"triton"`` on CPU tensors runs the kernel in the Triton interpreter and therefore needs ``TRITON_INTERPRET=1``
  set before the kernel modules are imported, i.e. before the package that owns the op (the testkit's pytest plugin
  sets it on machines without CUDA);
  without it, and for any other unknown name, a ``ValueError`` says which op, which source (argument or variable)
  and how to fix it.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import Literal

import torch

BACKENDS = ("auto", "triton", "reference")
GLOBAL_ENV_VAR = "DSV4_BACKEND"

Backend = Literal["auto", "triton", "reference"]


def package_env_var(op: str) -> str:
    """The per-package override variable of ``op`` (``"mhc.pre_mix"`` -> ``"MHC_BACKEND"``)."""
    return op.split(".", 1)[0].upper() + "_BACKEND"


def env_backend(op: str) -> tuple[str, str] | None:
    """``(backend, variable)`` set in the environment for ``op`` (package variable first, then
    :data:`GLOBAL_ENV_VAR`), or ``None`` when both are unset, empty or ``auto``."""
    for var in (package_env_var(op), GLOBAL_ENV_VAR):
        value = os.environ.get(var, "").strip().lower()
        if not value or value == "auto":
            continue
        if value not in BACKENDS:
            raise ValueError(f"environment variable {var}={value!r} must be one of {BACKENDS} (read by {op})")
        return value, var
    return None


def normalize_backend(
    backend: str,
    op: str,
    choices: Collection[str] = BACKENDS,
    aliases: dict[str, str] | None = None,
) -> str:
    """Validate a ``backend=`` argument against ``choices`` (after mapping ``aliases``)."""
    aliases = aliases or {}
    backend = aliases.get(backend, backend)
    if backend not in choices:
        accepted = tuple(choices) + tuple(aliases)
        raise ValueError(f"{op}: backend must be one of {accepted}, got {backend!r}")
    return backend


def triton_usable(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on ``t``: a CUDA tensor, or a CPU tensor under ``TRITON_INTERPRET=1``."""
    return t.is_cuda or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1")


def resolve_backend(
    backend: str,
    *tensors: torch.Tensor | None,
    op: str,
    triton_dtypes: Collection[torch.dtype] | None = None,
) -> Literal["triton", "reference"]:
    """Return ``"triton"`` or ``"reference"`` for ``op`` called with ``backend`` on ``tensors`` (module docstring).

    Args:
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.
        tensors: the op's inputs (entries that are not tensors, e.g. ``None``, are ignored).
        op: ``"<package>.<name>"``, e.g. ``"csa_kernels.sparse_attn"``: names the op in errors and picks the
            package's environment variable.
        triton_dtypes: dtypes the kernel handles; ``"auto"`` takes the reference for other dtypes.

    Raises:
        ValueError: unknown backend name (argument or variable), or ``"triton"`` for tensors that are neither on
            CUDA nor on the CPU under ``TRITON_INTERPRET=1``.
    """
    backend = normalize_backend(backend, op, BACKENDS)
    present = [t for t in tensors if isinstance(t, torch.Tensor)]
    source = f"backend={backend!r}"
    if backend == "auto":
        env = env_backend(op)
        if env is None:
            on_cuda = bool(present) and all(t.is_cuda for t in present)
            dtypes_ok = triton_dtypes is None or all(t.dtype in triton_dtypes for t in present)
            return "triton" if on_cuda and dtypes_ok else "reference"
        backend, var = env
        source = f"{var}={backend}"
    if backend == "triton":
        for t in present:
            if not triton_usable(t):
                raise ValueError(
                    f"{op}: {source} needs a CUDA tensor, got a tensor on {t.device}; use backend='reference' "
                    "(or 'auto') on CPU, or set TRITON_INTERPRET=1 before importing the kernels to run them in the "
                    "Triton interpreter"
                )
    return backend
