"""Optional dependencies: one check that names the pip extra to install.

Every package keeps its megatron-core glue in a ``megatron`` subpackage behind a ``[megatron]`` extra; importing it
without megatron-core raises an ``ImportError`` that says what to install (no stand-ins, no silent fallback).
"""

from __future__ import annotations

import importlib.util


def has_megatron() -> bool:
    """Whether megatron-core is importable (checked without importing it)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # no top-level ``megatron`` package at all
        return False


def require_megatron(extra: str, what: str) -> None:
    """Raise ``ImportError`` naming ``pip install '<extra>'`` when megatron-core is missing.

    Args:
        extra: the requirement that provides it, e.g. ``"mhc[megatron]"``.
        what: the module or feature that needs it, e.g. ``"mhc.megatron"``.
    """
    if not has_megatron():
        raise ImportError(
            f"{what} needs megatron-core, which is not installed; install the extra: pip install '{extra}' "
            "(in this workspace: uv sync)",
            name="megatron.core",
        )
