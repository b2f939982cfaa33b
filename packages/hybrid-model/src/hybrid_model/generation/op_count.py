"""``count_ops``: host syncs, host -> device uploads and aten ops of a piece of code, per module scope, on any device.

A decode step on a GPU is launch bound when it stalls the launch queue: every host sync (the host waits for the
device) and every small upload (a host tensor copied to the device) costs a round trip. No profiler is needed to count
them; one :class:`~torch.utils._python_dispatch.TorchDispatchMode` plus four patched ``Tensor`` methods see them on
CPU too (so the counts are a CPU test)::

    op      every aten op that reaches the dispatcher (views and in-place ops included)
    sync    aten._local_scalar_dense   (.item(), int(t), float(t), bool(t), a tensor in an `if`)
            aten.nonzero, masked_select, unique*, repeat_interleave without output_size, index / index_put with a
            bool mask                  (an output shape that depends on the values: the device reports it back)
            Tensor.tolist / .numpy / .cpu (patched: on CPU they do not dispatch)
            -- none of these on a host copy: the result of ``.cpu()`` and what aten ops make of host copies alone
            (megatron's ``tokens_per_expert = ....cpu()`` then ``.tolist()``: one sync, not two)
    upload  aten.lift_fresh            (torch.tensor / torch.as_tensor of Python data; not inside dsv4-primitives'
                                       ``upload_host_ints``, a cached device constant on CUDA: listed in ``sites``
                                       as "cached upload" only)
            Tensor.to / .cuda of a CPU tensor to another device (patched; so on a CPU-only run only the
            tensors built from Python data count: a host tensor moved with ``.to(device)`` is not seen there)

Ops run on behalf of a sync or an upload (e.g. the copy under ``.tolist()``) count as ops too. Each event is charged
to the innermost running module given in ``scopes`` (a forward pre-hook / hook pair), else to ``"other"``; sync and
upload events keep their Python call site (file:line of the first frame outside torch) in :attr:`ScopeCounts.sites`.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",
        "nonzero",
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
    }
)
_MASK_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})


@dataclass
class ScopeCounts:
    """The events of one scope. ``sites``: ``"sync file:line"`` / ``"upload file:line"`` -> how often."""

    ops: int = 0
    syncs: int = 0
    uploads: int = 0
    sites: Counter = field(default_factory=Counter)

    def add(self, other: ScopeCounts) -> None:
        self.ops += other.ops
        self.syncs += other.syncs
        self.uploads += other.uploads
        self.sites.update(other.sites)


def _call_site() -> str:
    frame = sys._getframe(2)
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    here = __file__
    while frame is not None and (
        frame.f_code.co_filename.startswith(torch_dir) or frame.f_code.co_filename == here
    ):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"


def _in_cached_upload() -> bool:
    """Inside dsv4-primitives' ``upload_host_ints``: on CUDA a cached device constant (copied on its first use
    only), so not an upload of every step; on CPU it builds a tensor each call."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "upload_host_ints":
            return True
        frame = frame.f_back
    return False


def _is_sync(func, args, kwargs) -> bool:
    name = func._schema.name.split("::")[-1]
    if name in _SYNC_OPS:
        return True
    if name == "repeat_interleave":
        return isinstance(args[0], torch.Tensor) and kwargs.get("output_size") is None and len(args) < 3
    if name in _MASK_INDEX_OPS and len(args) > 1 and isinstance(args[1], list | tuple):
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
    return False


def _moves_to_device(t: torch.Tensor, args, kwargs) -> bool:
    """``t.to(...)`` with these arguments copies a CPU tensor to another device."""
    target = kwargs.get("device")
    if target is None:
        target = next(
            (a for a in args if isinstance(a, torch.device | str | int) and not isinstance(a, bool)), None
        )
    if target is None or t.device.type != "cpu":
        return False
    return torch.device(target).type != "cpu"


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, ScopeCounts] = {}
        self.stack: list[str] = []
        # > 0 inside a patched method: its own aten ops are not counted again as syncs / uploads
        self.quiet = 0
        self._host: dict[int, weakref.ref] = {}  # host copies (.cpu() results and what is made of them)

    def is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def mark_host(self, t: torch.Tensor) -> None:
        self._host[id(t)] = weakref.ref(t)

    def on_host(self, args) -> bool:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        return bool(tensors) and all(self.is_host(t) for t in tensors)

    def _scope(self) -> ScopeCounts:
        return self.counts.setdefault(self.stack[-1] if self.stack else "other", ScopeCounts())

    def event(self, kind: str) -> None:
        scope = self._scope()
        if kind == "uploads" and _in_cached_upload():
            scope.sites[f"cached upload {_call_site()}"] += 1
            return
        setattr(scope, kind, getattr(scope, kind) + 1)
        scope.sites[f"{kind[:-1]} {_call_site()}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._scope().ops += 1
        flat = [*args, *(a for arg in args if isinstance(arg, list | tuple) for a in arg)]
        host = self.on_host(flat)
        if not self.quiet and not host:
            name = func._schema.name.split("::")[-1]
            if name == "lift_fresh":
                self.event("uploads")
            elif _is_sync(func, args, kwargs):
                self.event("syncs")
        out = func(*args, **kwargs)
        if host and "device" not in kwargs:
            for t in out if isinstance(out, list | tuple) else (out,):
                if isinstance(t, torch.Tensor):
                    self.mark_host(t)
        return out


@contextlib.contextmanager
def _patched(recorder: _Recorder) -> Iterator[None]:
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu", "to", "cuda")}

    def wrap(name: str, kind: str, applies):
        original = originals[name]

        def method(self, *args, **kwargs):
            counted = not recorder.is_host(self) and applies(self, args, kwargs)
            if counted:
                recorder.event(kind)
            recorder.quiet += counted
            try:
                out = original(self, *args, **kwargs)
            finally:
                recorder.quiet -= counted
            if isinstance(out, torch.Tensor) and (
                name == "cpu" or (recorder.is_host(self) and kind == "syncs")
            ):
                recorder.mark_host(out)
            return out

        return method

    def always(_t, _args, _kwargs) -> bool:
        return True

    def from_cpu(t, _args, _kwargs) -> bool:
        return t.device.type == "cpu"

    torch.Tensor.tolist = wrap("tolist", "syncs", always)
    torch.Tensor.numpy = wrap("numpy", "syncs", always)
    torch.Tensor.cpu = wrap("cpu", "syncs", always)
    torch.Tensor.to = wrap("to", "uploads", _moves_to_device)
    torch.Tensor.cuda = wrap("cuda", "uploads", from_cpu)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@contextlib.contextmanager
def count_ops(scopes: Mapping[torch.nn.Module, str] | None = None) -> Iterator[dict[str, ScopeCounts]]:
    """Inside the block, count every op / sync / upload (module docstring); yields ``{scope name: ScopeCounts}``
    (filled as the block runs). ``scopes``: module -> scope name (several modules may share a name)."""
    scopes = dict(scopes or {})
    recorder = _Recorder()

    def enter(name: str):
        def hook(_module, _args) -> None:
            recorder.stack.append(name)

        return hook

    def leave(_module, _args, _output) -> None:
        recorder.stack.pop()

    handles = []
    for module, name in scopes.items():
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave))
    try:
        with _patched(recorder), recorder:
            yield recorder.counts
    finally:
        for handle in handles:
            handle.remove()


def total(counts: Mapping[str, ScopeCounts]) -> ScopeCounts:
    """The sum of every scope's counts."""
    out = ScopeCounts()
    for c in counts.values():
        out.add(c)
    return out
