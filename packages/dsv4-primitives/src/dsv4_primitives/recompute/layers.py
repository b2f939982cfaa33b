"""Full recompute of whole layers: megatron-core's reentrant ``tensor_parallel.checkpoint`` on CUDA.

On CUDA this is exactly megatron's ``checkpoint(fn, distribute_saved_activations=False, *args)`` (its RNG tracker's
states are stashed and restored, as for megatron's own full recompute). megatron's version reads CUDA RNG states
unconditionally, so on CPU PyTorch's reentrant ``torch.utils.checkpoint`` (the same semantics, CPU RNG state
preserved) runs instead. Either way the forward runs without autograd and the layers run again in backward: state
updates guarded by ``torch.is_grad_enabled()`` (expert-load counters, loss trackers) happen once, in the recompute.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def checkpoint_layers(fn: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """``fn(*args)`` with only ``args`` kept; ``fn`` runs again in backward (reentrant checkpoint)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        return tensor_parallel.checkpoint(fn, False, *args)
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)
