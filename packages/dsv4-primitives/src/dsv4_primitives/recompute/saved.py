"""Dropping a forward tensor from what autograd keeps for backward, and rebuilding it there from a recipe.

An op saves its inputs (and sometimes outputs) for its backward. :func:`discard` marks a tensor ``y`` of the forward
with a *recipe* that recomputes it; while a :func:`recompute_scope` is active, every copy of ``y`` (or of a view of
its storage) that an op saves is stored as a small handle instead, and the first backward that needs it calls the
recipe once (the result is shared by every node holding the handle, and freed with the last of them)::

    with recompute_scope():
        y = norm(x)                                 # norm's backward keeps x and rstd, not y
        discard(y, lambda: norm(x))                 # recipe: runs without grad in backward
        out = linear(y)                             # linear saves a handle instead of y

The mechanism is ``torch.autograd.graph.saved_tensors_hooks``: an outer pair of hooks (CPU offloading, a
saved-bytes counter) keeps seeing every other tensor. Nothing is stored in the tensor itself, so no storage
swapping (megatron's ``CheckpointWithoutOutput`` resizes storages and compiles a C++ helper to share them back)
and no version-counter games are needed. A registration is forgotten when its tensor is freed (weak reference),
so a later tensor reusing the memory is never mistaken for it.

The recipe must reproduce ``y`` bit for bit (deterministic kernels, same inputs, same layout): the recomputed
tensor replaces ``y`` in every backward formula. :class:`Recomputable` checks shape, dtype and strides.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


class Recomputable:
    """A forward tensor's layout and the recipe that rebuilds it (the recipe's result is cached until released)."""

    __slots__ = ("_recipe", "_value", "dtype", "offset", "shape", "stride")

    def __init__(self, tensor: torch.Tensor, recipe: Callable[[], torch.Tensor]) -> None:
        self._recipe: Callable[[], torch.Tensor] | None = recipe
        self._value: torch.Tensor | None = None
        self.shape, self.stride = tuple(tensor.shape), tuple(tensor.stride())
        self.offset, self.dtype = tensor.storage_offset(), tensor.dtype

    def value(self) -> torch.Tensor:
        """The recomputed tensor (the recipe runs on the first call)."""
        if self._value is None:
            if self._recipe is None:
                raise RuntimeError("a discarded activation was needed after its recompute was released")
            v = self._recipe()
            if tuple(v.shape) != self.shape or v.dtype != self.dtype or tuple(v.stride()) != self.stride:
                raise RuntimeError(
                    f"recompute produced {v.dtype} {tuple(v.shape)} strides {tuple(v.stride())}, the forward had "
                    f"{self.dtype} {self.shape} strides {self.stride}: the recipe does not rebuild the same tensor"
                )
            self._value = v.detach()
        return self._value

    def view_of(self, shape, stride, offset: int) -> torch.Tensor:
        """The view of the recomputed tensor that a saved view ``(shape, stride, offset)`` of the original was."""
        v = self.value()
        return v.as_strided(shape, stride, v.storage_offset() + offset - self.offset)


class _Handle:
    """What autograd stores instead of a discarded tensor (or a view of it)."""

    __slots__ = ("offset", "rec", "shape", "stride")

    def __init__(self, rec: Recomputable, t: torch.Tensor) -> None:
        self.rec, self.shape, self.stride, self.offset = rec, tuple(t.shape), t.stride(), t.storage_offset()


class _Outer:
    """A tensor packed by the saved-tensor hooks that were active outside the scope."""

    __slots__ = ("packed",)

    def __init__(self, packed) -> None:
        self.packed = packed


# storage address -> (weak reference to the registered tensor, its Recomputable), for the active scope
_REGISTRY: dict[int, tuple[weakref.ref, Recomputable]] = {}
_DEPTH = [0]


def _forget(ptr: int, ref: weakref.ref) -> None:
    entry = _REGISTRY.get(ptr)
    if entry is not None and entry[0] is ref:
        del _REGISTRY[ptr]


def discard(tensor: torch.Tensor, recipe: Callable[[], torch.Tensor] | Recomputable) -> Recomputable:
    """Let backward rebuild ``tensor`` with ``recipe`` instead of keeping the copies ops save of it.

    Needs an active :func:`recompute_scope` (``RuntimeError`` otherwise: the registration would do nothing).
    A plain ``recipe`` runs under ``torch.no_grad()``; a :class:`Recomputable` is taken as is (a checkpointed
    region's, which rebuilds its graph). Returns the :class:`Recomputable`."""
    if not _DEPTH[0]:
        raise RuntimeError("discard() needs an active recompute_scope()")
    if not isinstance(recipe, Recomputable):
        recipe = Recomputable(tensor, torch.no_grad()(recipe))
    rec = recipe
    ptr = tensor.untyped_storage().data_ptr()
    ref = weakref.ref(tensor, lambda r, p=ptr: _forget(p, r))
    _REGISTRY[ptr] = (ref, rec)
    return rec


def scope_active() -> bool:
    """Whether a :func:`recompute_scope` is active."""
    return _DEPTH[0] > 0


@contextmanager
def recompute_scope() -> Iterator[None]:
    """Saved-tensor hooks that store :func:`discard`-ed tensors as recompute handles (re-entrant: a nested scope
    reuses the outer one). Registrations end with the outermost scope."""
    if _DEPTH[0]:
        _DEPTH[0] += 1
        try:
            yield
        finally:
            _DEPTH[0] -= 1
        return
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)

    def pack(t: torch.Tensor):
        if _REGISTRY:
            entry = _REGISTRY.get(t.untyped_storage().data_ptr())
            if entry is not None and entry[0]() is not None and t.dtype == entry[1].dtype:
                return _Handle(entry[1], t)
        return t if outer is None else _Outer(outer[0](t))

    def unpack(packed) -> torch.Tensor:
        if isinstance(packed, _Handle):
            return packed.rec.view_of(packed.shape, packed.stride, packed.offset)
        if isinstance(packed, _Outer):
            return outer[1](packed.packed)
        return packed

    _DEPTH[0] = 1
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        _DEPTH[0] = 0
        _REGISTRY.clear()


def discard_derived(out: torch.Tensor, src: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """When ``src`` is :func:`discard`-ed in the active scope, discard ``out = fn(src)`` too (recipe: ``fn`` of the
    rebuilt ``src``, without grad). For copies an op makes of a discarded tensor before saving them (a padded or
    gathered operand). Returns whether ``out`` was registered."""
    if not _DEPTH[0] or not _REGISTRY:
        return False
    entry = _REGISTRY.get(src.untyped_storage().data_ptr())
    if entry is None or entry[0]() is None or src.dtype != entry[1].dtype:
        return False
    rec, view = entry[1], (tuple(src.shape), src.stride(), src.storage_offset())

    discard(out, lambda: fn(rec.view_of(*view)))
    return True


def registered(t: torch.Tensor) -> Recomputable | None:
    """The :class:`Recomputable` under which ``t``'s storage is discarded in the active scope, or ``None``.

    ``discard(view, registered(t))`` keeps the registration alive through a new view ``view`` of ``t`` (a
    registration ends when its tensor object is freed; a reshaped view returned to the caller outlives ``t``)."""
    if not _DEPTH[0] or not _REGISTRY:
        return None
    entry = _REGISTRY.get(t.untyped_storage().data_ptr())
    if entry is None or entry[0]() is None or t.dtype != entry[1].dtype:
        return None
    return entry[1]
