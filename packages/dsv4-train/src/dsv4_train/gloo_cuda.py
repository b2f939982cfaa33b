"""``dsv4 train --dist-backend gloo`` on CUDA: the distributed optimizer's collectives staged through host memory.

gloo runs its collectives on host threads. PyTorch's gloo backend copies CUDA tensors to pinned host memory for
``all_reduce`` (and ``broadcast``), but the coalesced forms megatron-core 0.19.2's distributed optimizer issues —
the gradient reduce-scatter and the parameter all-gather, both inside ``torch.distributed._coalescing_manager`` —
are host-memory code paths in gloo, not validated on CUDA tensors. While :func:`host_staged_collectives` is active,
megatron's ``param_and_grad_buffer`` module (its ``_coalescing_manager``, ``dist_reduce_scatter_func`` and
``dist_all_gather_func``) uses synchronous stand-ins that, for a gloo group and CUDA tensors, copy to host memory,
run the collective there, and copy the result back:

* reduce-scatter = all-reduce of the whole buffer + this rank's slice, the fallback the CPU context-parallel
  collectives use (``dsv4_attention.cp.comm``; it is also how gloo implements reduce-scatter itself);
* all-gather = gloo's host all-gather into a host buffer.

The values are those of the gloo collectives on host tensors (a sum of the same operands), only slower; everything
else (NCCL groups, CPU tensors) goes to the original functions. It exists so that data parallelism can be tested
with several processes on ONE GPU, which NCCL refuses (two ranks cannot share a device); use NCCL for real runs.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core.distributed import param_and_grad_buffer as pgb


def _staged(tensor: torch.Tensor, group, cpu_too: bool) -> bool:
    return (tensor.is_cuda or cpu_too) and dist.get_backend(group) == "gloo"


class _DoneWork:
    """The handle of a collective that already finished (what megatron waits on with ``async_op=True``)."""

    def wait(self) -> None:
        pass


def _staging_functions(reduce_scatter, all_gather, coalescing_manager, cpu_too: bool):
    def staged_reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not _staged(input, group, cpu_too):
            return reduce_scatter(output, input, op=op, group=group, async_op=async_op)
        host = input.detach().to("cpu", copy=True)
        dist.all_reduce(host, op=op, group=group)
        output.copy_(host.chunk(dist.get_world_size(group))[dist.get_rank(group)])
        return _DoneWork() if async_op else None

    def staged_all_gather(output, input, group=None, async_op=False):
        if not _staged(input, group, cpu_too):
            return all_gather(output, input, group=group, async_op=async_op)
        host_out = torch.empty(output.shape, dtype=output.dtype, device="cpu")
        dist.all_gather_into_tensor(host_out, input.detach().to("cpu", copy=True), group=group)
        output.copy_(host_out)
        return _DoneWork() if async_op else None

    @contextlib.contextmanager
    def staged_coalescing_manager(group=None, device=None, async_ops=False):
        if dist.get_backend(group) != "gloo":
            with coalescing_manager(group, device=device, async_ops=async_ops) as cm:
                yield cm
            return
        yield _DoneWork()  # the staged collectives inside run one by one, synchronously

    return staged_reduce_scatter, staged_all_gather, staged_coalescing_manager


@contextlib.contextmanager
def host_staged_collectives(*, cpu_too: bool = False):
    """Route megatron's distributed-optimizer collectives over gloo groups through host memory (see the module
    docstring) for the duration of the block; restored on exit. ``cpu_too``: stage CPU tensors as well (tests: the
    staged arithmetic checked on a machine without CUDA)."""

    names = ("dist_reduce_scatter_func", "dist_all_gather_func", "_coalescing_manager")
    saved = {name: getattr(pgb, name) for name in names}
    staged = _staging_functions(*(saved[name] for name in names), cpu_too)
    for name, fn in zip(names, staged):
        setattr(pgb, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(pgb, name, fn)
