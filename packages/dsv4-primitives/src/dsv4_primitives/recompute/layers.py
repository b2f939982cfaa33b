"""Full recompute of whole layers: megatron-core's reentrant ``tensor_parallel.checkpoint`` on CUDA.

On CUDA this is exactly megatron's ``checkpoint(fn, distribute_saved_activations=False, *args)`` (its RNG tracker's
states are stashed and restored, as for megatron's own full recompute). megatron's version reads CUDA RNG states
unconditionally, so on CPU PyTorch's reentrant ``torch.utils.checkpoint`` (the same semantics, CPU RNG state
preserved) runs instead. Either way the forward runs without autograd and the layers run again in backward: state
updates guarded by ``torch.is_grad_enabled()`` (expert-load counters, loss trackers) happen once, in the recompute.

Both reentrant backwards keep the recomputed outputs in a local variable while they run the chunk's inner backward
(``torch.autograd.backward(outputs, grads)``), although no gradient formula reads them: for an mHC layer that is
its fp32 output streams ``[S, B, n·d]`` (issue #33: 64 KiB per token of flash-smoke, alive at the step's peak).
The recompute therefore hands them back as :class:`_Released` stand-ins: same shape, dtype and autograd edge, but
no data (a stride-0 view of one element); the real outputs die when the recompute returns, unless a backward
formula of the chunk saved them. Gradients are unchanged (the stand-in's backward passes the gradient through).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _Released(torch.autograd.Function):
    """Identity for autograd whose output holds no data: ``x``'s shape and dtype over one element (stride 0).
    Only a backward root may be made of it (its values are not ``x``'s)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(()).expand(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def release_outputs(out):
    """The recomputed output(s) ``out`` (a tensor or a tuple) as backward roots without data (:class:`_Released`);
    tensors without gradient pass through."""
    if isinstance(out, torch.Tensor):
        return _Released.apply(out) if out.requires_grad else out
    if isinstance(out, tuple):
        return tuple(release_outputs(o) for o in out)
    return out


def checkpoint_layers(fn: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """``fn(*args)`` with only ``args`` kept; ``fn`` runs again in backward (reentrant checkpoint), where its
    outputs are not kept during the chunk's backward (module doc)."""
    if not torch.is_grad_enabled():
        return fn(*args)

    def run(*a):
        out = fn(*a)
        # the checkpoint's forward runs without autograd (real outputs); the recompute in backward with it
        return release_outputs(out) if torch.is_grad_enabled() else out

    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        return tensor_parallel.checkpoint(run, False, *args)
    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=True)
