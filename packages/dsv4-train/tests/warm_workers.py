"""``run_warm(fn, world_size, *args)``: ``dsv4_testkit.run_distributed`` with its gloo workers forked from a warm
server process instead of spawned as fresh interpreters.

A spawned worker starts a new interpreter and imports torch, megatron-core and ``dsv4_train`` again before it runs
anything: about 5 s of CPU per worker, most of a tiny run's cost. Here the workers come from a multiprocessing
*forkserver*: one process per test process, started on the first call, that imports :data:`PRELOAD` once and then
forks a worker per rank. The worker is the spawned one otherwise: the caller's ``sys.path`` and working directory
(multiprocessing's preparation data, as for spawn), the caller's environment as it is at the call (the server's was
fixed when it started), one thread, a fresh gloo group on a free loopback port, ``fn(rank, world_size, *args)``,
its result through ``torch.save``. Nothing but imports ran in the server (no megatron state, no RNG draws, no
threads), so a forked worker starts from the same state as a spawned one: a 1-step ``dsv4 train --pp 2`` in 2
workers logs the same metrics bit for bit either way (13 s of CPU spawned, 2.2 s forked, this machine).

One difference: a worker's stdout / stderr are the server's, i.e. those of the test that started it (pytest's
capture of that test), not the calling test's; a failing rank's traceback still comes back through the queue.

It is ``dsv4_testkit.run_distributed`` itself (its ``context`` argument), with the same contract: results in rank
order, a failed rank's traceback re-raised in the caller, the other ranks stopped ``FAILURE_GRACE_S`` after the
first failure, a new port when another process took the rendezvous port first."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv4_testkit import run_distributed

#: what the server imports once (everything the workers of this folder's runners import that takes time to import)
PRELOAD = [
    "pytest",
    "torch.distributed.checkpoint",
    "megatron.core",
    "megatron.core.distributed.param_and_grad_buffer",
    "dsv4_train.cli",
    "dsv4_train.trainer",
    "dsv4_train.virtual_pipeline",
]
_CONTEXT: list = []  # the forkserver context, made on the first call


def _context():
    if not _CONTEXT:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CONTEXT.append(ctx)
    return _CONTEXT[0]


def run_warm(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks forked from the warm server; the per-rank results
    in rank order. ``fn``: a module-level function (pickled by name)."""
    return run_distributed(fn, world_size, *args, timeout=timeout, context=_context())


def probe(rank: int, world_size: int, key: str) -> tuple:
    """A worker's view (test_warm_workers.py): its rank, the gloo world size, ``os.environ[key]``, its threads and the
    sum of the ranks over the group."""
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank, dist.get_world_size(), os.environ.get(key), torch.get_num_threads(), float(total)


def fail_on(rank: int, world_size: int, bad: int) -> int:
    """Raises on rank ``bad`` (test_warm_workers.py); the other ranks return their rank."""
    if rank == bad:
        raise ValueError(f"rank {rank} fails on purpose")
    return rank
