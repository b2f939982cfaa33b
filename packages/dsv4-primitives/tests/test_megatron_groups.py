"""Releasing megatron-core's process groups and the reference cycle that keeps a finished model alive
(``dsv4_primitives.megatron.groups``)."""

import gc
import os
import weakref

import pytest
import torch

from dsv4_testkit import run_distributed

pytestmark = pytest.mark.distributed


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _init_and_destroy(rank: int, world: int, cycles: int) -> dict:
    """``cycles`` times: megatron's parallel state up (a CP layout over the world) and torn down."""
    from megatron.core import parallel_state as ps

    from dsv4_primitives.megatron import cpu_shims, destroy_model_parallel, process_groups

    before = process_groups()
    threads, created, destroyed = [_threads()], [], []
    with cpu_shims():
        for _ in range(cycles):
            ps.initialize_model_parallel(context_parallel_size=world)
            created.append(len(process_groups()) - len(before))
            destroyed.append(destroy_model_parallel(keep=before))
            gc.collect()
            threads.append(_threads())
    return {
        "kept": process_groups() == before,
        "created": created,
        "destroyed": destroyed,
        "threads": threads,
        "left_set": [
            ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP,
            ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO,
        ],
    }


def test_destroy_model_parallel_destroys_every_group_megatron_created():
    """megatron's teardown alone leaves ~20 groups registered per cycle (each gloo group with threads that poll
    every 10 ms); with ``destroy_model_parallel`` the registry and the thread count return to where they were."""
    for rank in run_distributed(_init_and_destroy, 2, 3):
        assert rank["kept"]
        # megatron's own teardown destroys a few of its groups; the rest are left to us
        assert all(c >= 10 and 0 < d <= c for c, d in zip(rank["created"], rank["destroyed"], strict=True)), (
            rank
        )
        assert rank["left_set"] == [None, None]
        # the first cycle may start lazily created pools; after it, no cycle adds a thread
        assert rank["threads"][2] == rank["threads"][3] <= rank["threads"][0] + 4, rank["threads"]


class _Dispatcher:
    """Like megatron's MoE token dispatchers: a plain object (not a module) that keeps the last forward's
    probabilities, graph included."""

    local_probs: torch.Tensor | None = None


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))
        self.dispatcher = _Dispatcher()
        self.last = None

    def forward(self, x):
        self.dispatcher.local_probs = (self.weight * x).softmax(-1)
        self.last = self.weight * 2  # a module attribute with a graph too
        return (self.dispatcher.local_probs * x).sum()


def _model_with_ddp_like_hook():
    """A model whose parameter's gradient accumulator holds a hook closing over the model (what megatron's DDP
    registers): model -> dispatcher -> graph -> accumulator (C++) -> hook -> model."""
    model = _Layer()
    acc = model.weight.expand_as(model.weight).grad_fn.next_functions[0][0]

    def hook(*_):  # closes over the model, as DDP's backward post-hook closes over DDP
        assert model.weight.grad is not None

    acc.register_hook(hook)
    model.grad_accs = [acc]  # DDP keeps its hooked accumulators
    model(torch.randn(4)).backward()
    return model


def test_a_kept_graph_keeps_the_model_alive_until_released():
    from dsv4_primitives.megatron import release_autograd_graphs

    leaked = _model_with_ddp_like_hook()
    ref = weakref.ref(leaked)
    del leaked
    gc.collect()
    assert (
        ref() is not None
    )  # the cycle runs through C++ autograd nodes: the garbage collector cannot free it
    assert release_autograd_graphs(ref()) == 2
    assert ref().dispatcher.local_probs is None and ref().last is None
    gc.collect()
    assert ref() is None
    released = _model_with_ddp_like_hook()
    assert release_autograd_graphs(released) == 2
    assert release_autograd_graphs(released) == 0
    assert released.weight.grad is not None  # parameters and their gradients are untouched


def test_removing_the_accumulator_hooks_breaks_the_cycle_too():
    from dsv4_primitives.megatron import remove_grad_accumulator_hooks

    model = _model_with_ddp_like_hook()
    ref = weakref.ref(model)
    assert remove_grad_accumulator_hooks(model) == 1
    assert model.grad_accs == [] and remove_grad_accumulator_hooks(model) == 0
    assert model.dispatcher.local_probs.grad_fn is not None  # the graph is still there, the hook is not
    del model
    gc.collect()
    assert ref() is None
