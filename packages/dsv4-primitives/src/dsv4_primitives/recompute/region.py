"""Checkpointed regions: a function that runs without autograd in forward and again, with it, in backward.

:func:`checkpoint_region` ``(fn, *args, discard_outputs=False)`` is megatron's ``CheckpointWithoutOutput`` on
``torch.autograd.graph`` hooks instead of storage surgery (see :mod:`dsv4_primitives.recompute.saved`):

* forward: ``fn(*args)`` under ``torch.no_grad()`` (nothing inside is kept), the tensor arguments are saved;
* backward: ``fn`` runs again on the saved arguments with autograd on, under the forward's RNG states, and the
  incoming gradients are back-propagated through that graph (parameters used inside ``fn`` get their gradients
  there, as with megatron's reentrant ``checkpoint``);
* ``discard_outputs=True`` (inside a :func:`~dsv4_primitives.recompute.saved.recompute_scope`): the outputs are
  not kept by the ops that read them either; the first backward that needs one recomputes the region.

The region's saved arguments go through the active saved-tensor hooks, so a region whose input is itself a
discarded output rebuilds it on demand: regions chain (the mHC streams of a recompute group).

``fn`` must be deterministic and return a tensor or a tuple of tensors / ``None``; side effects that depend on
``torch.is_grad_enabled()`` (loss trackers, expert-load counters) run once, in the recompute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from dsv4_primitives.recompute.saved import Recomputable, discard


@contextlib.contextmanager
def _forked_rng(states):
    """Run under the RNG ``states`` of :func:`_rng_states`, restoring the current ones afterwards."""
    cpu, cuda = states
    now_cpu = torch.get_rng_state()
    now_cuda = _cuda_states() if cuda is not None else None
    torch.set_rng_state(cpu)
    if cuda is not None:
        _set_cuda_states(cuda)
    try:
        yield
    finally:
        torch.set_rng_state(now_cpu)
        if now_cuda is not None:
            _set_cuda_states(now_cuda)


def _cuda_states():
    """megatron's CUDA RNG states (default generator, graph-safe under capture, and its tracker's named states)."""
    from megatron.core.tensor_parallel.random import _get_all_rng_states

    return _get_all_rng_states()


def _set_cuda_states(states) -> None:
    from megatron.core.tensor_parallel.random import _set_all_rng_states

    _set_all_rng_states(*states)


def _rng_states():
    cuda = _cuda_states() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


class _Region:
    """One call of a checkpointed region: the function, its RNG states, the autograd ctx and the recomputed graph."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.rng = _rng_states()
        self.ctx = None
        self.inputs: tuple | None = None
        self.outputs: tuple | None = None
        self.single = False

    def recompute(self) -> tuple:
        """The region's outputs rebuilt with autograd (once; kept until the region's backward used them)."""
        if self.outputs is None:
            saved = self.ctx.saved_tensors
            it = iter(saved)
            inputs = []
            for a, needs in zip(self.ctx.arg_slots, self.ctx.arg_grads, strict=True):
                if a is _TENSOR:
                    t = next(it).detach()
                    inputs.append(t.requires_grad_(needs))
                else:
                    inputs.append(a)
            with _forked_rng(self.rng), torch.enable_grad():
                out = self.fn(*inputs)
            self.inputs = tuple(inputs)
            self.outputs = (out,) if isinstance(out, torch.Tensor) or out is None else tuple(out)
        return self.outputs


_TENSOR = object()


class _RegionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, region: _Region, *args):
        with torch.no_grad():
            out = region.fn(*args)
        region.single = isinstance(out, torch.Tensor)
        ctx.arg_slots = tuple(_TENSOR if isinstance(a, torch.Tensor) else a for a in args)
        ctx.arg_grads = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        ctx.save_for_backward(*(a for a in args if isinstance(a, torch.Tensor)))
        ctx.region = region
        region.ctx = ctx
        return out

    @staticmethod
    def backward(ctx, *grads):
        region: _Region = ctx.region
        outputs = region.recompute()
        pairs = [
            (o, g)
            for o, g in zip(outputs, grads, strict=True)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        inputs = region.inputs
        region.inputs = region.outputs = None
        region.ctx = None
        return (None, *(a.grad if isinstance(a, torch.Tensor) else None for a in inputs))


def checkpoint_region(fn: Callable[..., Any], *args, discard_outputs: bool = False):
    """``fn(*args)``, recomputed in backward (see the module docstring). Without any argument that requires grad
    (e.g. under ``torch.no_grad()`` or in eval), ``fn`` simply runs."""
    if not torch.is_grad_enabled() or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return fn(*args)
    region = _Region(fn)
    out = _RegionFunction.apply(region, *args)
    if discard_outputs:
        outs = (out,) if isinstance(out, torch.Tensor) else out
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor):
                discard(o, Recomputable(o, lambda i=i: region.recompute()[i]))
    return out
