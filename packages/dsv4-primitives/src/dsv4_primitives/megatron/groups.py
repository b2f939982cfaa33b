"""Releasing the process groups of megatron-core's parallel state when it is torn down.

megatron-core 0.19.2's ``parallel_state.initialize_model_parallel`` creates about 23 process groups (each one
twice on some layouts: NCCL/gloo pairs). Its ``destroy_model_parallel`` forgets megatron's own references but leaves
every group registered with ``torch.distributed``, and it leaves two references set
(``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and its gloo twin). A gloo group owns transport threads that poll
every 10 ms for the life of the process, so a process that builds and destroys the parallel state again and again
(a test session, several layouts trained one after another in one set of processes, a sweep) accumulates them:
measured on a 2-core box, one pytest process held 809 such threads (about 80,000 wake-ups per second) and the
machine's load average reached 50, which slowed every multi-process test several-fold.

The groups are only freed (and their threads stopped) when nothing references them, and a model built on them
can outlive its owner: megatron-core 0.19.2's MoE token dispatchers keep the last forward's routing probabilities
(``local_probs``, a tensor with its autograd graph) as an attribute. That graph reaches the parameters' gradient
accumulators, whose DDP hooks hold the DDP wrapper and through it the model: a reference cycle through C++ autograd
nodes, which Python's garbage collector cannot see, so the model, its DDP and every group stay alive for the life
of the process. :func:`release_autograd_graphs` drops such tensors when the model is finished.

The same kind of cycle runs through megatron's DDP itself: its backward post-hooks, registered on the
parameters' gradient accumulators, close over the DDP wrapper, and any tensor that still carries a graph reaching
those accumulators (the distributed optimizer keeps such views of the parameters) closes the loop.
:func:`remove_grad_accumulator_hooks` removes those hooks when training is over.

:func:`destroy_model_parallel` is megatron's teardown followed by the destruction of every group created since a
snapshot taken with :func:`process_groups` before ``initialize_model_parallel``; the default group and any group
that existed at the snapshot are kept. Destroying a group is local (no collective), so ranks may do it at
different times; nothing may use the destroyed groups afterwards (the model, DDP and optimizer built on them are
finished).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

# parallel_state globals that megatron-core 0.19.2's destroy_model_parallel() does not reset
_LEFT_SET_BY_DESTROY = (
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
)


def process_groups() -> list[dist.ProcessGroup]:
    """The process groups registered with ``torch.distributed`` now (the default group included); ``[]`` when it
    is not initialised."""
    if not dist.is_initialized():
        return []
    return list(dist.distributed_c10d._world.pg_map)


def destroy_model_parallel(keep: Iterable[dist.ProcessGroup]) -> int:
    """``parallel_state.destroy_model_parallel()``, then destroy every registered group that is not in ``keep``
    (a :func:`process_groups` snapshot taken before ``initialize_model_parallel``) and is not the default group.

    Returns the number of groups destroyed."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    for name in _LEFT_SET_BY_DESTROY:
        setattr(parallel_state, name, None)
    if not dist.is_initialized():
        return 0
    kept = set(keep)
    world = dist.GroupMember.WORLD
    stale = [pg for pg in process_groups() if pg not in kept and pg is not world]
    for pg in stale:
        dist.destroy_process_group(pg)
    return len(stale)


def release_autograd_graphs(model: torch.nn.Module) -> int:
    """Set to ``None`` every attribute that holds a tensor with an autograd graph (``grad_fn``) on ``model``'s
    modules and on the plain objects they hold one level down (megatron's token dispatchers are not modules).

    Call it when the model is finished (before it is dropped): it breaks the reference cycle described in the
    module docstring. Returns the number of attributes cleared."""
    cleared = 0
    for module in model.modules():
        holders = [module] + [
            v
            for v in vars(module).values()
            if hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, torch.Tensor, type))
        ]
        for holder in holders:
            for name, value in list(vars(holder).items()):
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    setattr(holder, name, None)
                    cleared += 1
    return cleared


def _no_hook(*_unused) -> None:
    return None


def remove_grad_accumulator_hooks(ddp: torch.nn.Module) -> int:
    """Remove every backward post-hook from the gradient accumulators megatron's DDP hooked (``ddp.grad_accs``)
    and forget the accumulators. Call it when training is over (no backward may follow). Returns the number of
    hooks removed.

    The accumulators are C++ autograd nodes; their hooks live in one dict per node, reached through the handle
    of a (then removed) hook registered here."""
    accumulators = getattr(ddp, "grad_accs", [])
    removed = 0
    for acc in accumulators:
        # the node's one hook dict: megatron's hooks and the one just registered
        hooks = acc.register_hook(_no_hook).hooks_dict_ref()
        if hooks is not None:
            removed += len(hooks) - 1
            hooks.clear()
    accumulators.clear()
    return removed
