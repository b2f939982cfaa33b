"""Triton interpreter switch, and a guard against the interpreter's leaked patches of ``triton.language``.

On a machine without CUDA, kernels run under ``TRITON_INTERPRET=1``. ``triton.jit`` reads the variable when a kernel
is decorated, so :func:`ensure_interpreter_if_no_cuda` must run before any kernel module is imported. The pytest
plugin (:mod:`dsv4_testkit.plugin`) calls it at start-up.

Triton 3.6's interpreter runs a kernel with ``triton.language`` patched to interpreter implementations and restores
them after the launch, but a *device-function call* inside the kernel (``InterpretedFunction.__call__``, which is
what ``tl.sum`` / ``tl.max`` and the rest of ``triton.language.standard`` are under the interpreter) patches the
modules visible from the callee's globals (``triton.language.core`` for the standard library) and never restores
them. After one interpreted kernel that calls ``tl.sum``, ``tl.core``'s builtins stay interpreter lambdas for the
rest of the process, and a real compilation in the same process (the sm_90 compile-facts tests) fails inside the
code generator (``'ir.value' object has no attribute 'dtype'``): an order-dependent failure.
:func:`snapshot_triton_language` / :func:`restore_triton_language` record the pristine namespaces and put them
back; the plugin does this around every test.
"""

import os

_PRISTINE: list[tuple[object, dict]] | None = None
_SKIP = {"__annotations__", "__dict__", "__weakref__", "__doc__"}


def ensure_interpreter_if_no_cuda() -> None:
    """Set ``TRITON_INTERPRET=1`` when no CUDA device is present (idempotent; an explicit value wins)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _namespaces() -> list[object]:
    import triton.language as tl

    return [tl, tl.core, tl.math, tl.core.tensor, tl.core.tensor_descriptor_base]


def snapshot_triton_language() -> None:
    """Record the current (pristine) attributes of ``triton.language``, ``.core``, ``.math`` and the ``tensor``
    classes; call before any kernel is interpreted (idempotent: the first snapshot is kept)."""
    global _PRISTINE
    if _PRISTINE is None:
        _PRISTINE = [(ns, dict(vars(ns))) for ns in _namespaces()]


def restore_triton_language() -> list[str]:
    """Put back every attribute whose value differs from the snapshot; returns their names (``module.attr``), empty
    when nothing leaked. A no-op before :func:`snapshot_triton_language`.

    Names added since the snapshot are kept: the interpreter caches kernels rewritten against module globals it
    added (``interpreter_semantic``, ...), and the patches themselves only replace existing attributes.
    """
    if _PRISTINE is None:
        return []
    fixed = []
    for ns, saved in _PRISTINE:
        now = vars(ns)
        for name, value in saved.items():
            if name not in _SKIP and now.get(name, _PRISTINE) is not value:
                setattr(ns, name, value)
                fixed.append(f"{getattr(ns, '__name__', ns)}.{name}")
    return fixed
