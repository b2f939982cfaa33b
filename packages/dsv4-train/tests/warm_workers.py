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

Contract as ``dsv4_testkit.run_distributed``: results in rank order, a failed rank's traceback re-raised in the
caller, the other ranks stopped ``FAILURE_GRACE_S`` after the first failure, a new port when another process took
the rendezvous port first."""

from __future__ import annotations

import io
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv4_testkit.distributed import FAILURE_GRACE_S, PORT_ATTEMPTS, free_port

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


def _worker(rank: int, world_size: int, port: int, env: dict, fn: Callable, args: tuple, queue) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's environment at the call
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    except BaseException:  # the rendezvous failed: fn has not run
        failure = traceback.format_exc()
        queue.put((rank, "port taken" if "EADDRINUSE" in failure else "error", failure))
        return
    try:
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()  # through torch.save: a worker's shared-memory tensors are gone once it exits
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_warm(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks forked from the warm server; the per-rank results
    in rank order. ``fn``: a module-level function (pickled by name)."""
    if world_size < 1:
        raise ValueError(f"run_warm: world_size must be >= 1, got {world_size}")
    for _ in range(PORT_ATTEMPTS):
        results = _start(fn, world_size, args, timeout)
        if results is not None:
            return results
    raise RuntimeError(f"run_warm: {PORT_ATTEMPTS} rendezvous ports in a row were taken by other processes")


def _start(fn: Callable, world_size: int, args: tuple, timeout: float) -> list[Any] | None:
    ctx = _context()
    queue = ctx.SimpleQueue()
    port, env = free_port(), dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, env, fn, args, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}  # rank -> traceback
    failed_at = 0.0
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size and time.monotonic() <= deadline:
        if queue.empty():
            if not any(p.is_alive() for p in procs) and queue.empty():
                break
            if errors and time.monotonic() > failed_at + FAILURE_GRACE_S:
                break  # the rest are most likely blocked in a collective with the failed rank
            time.sleep(0.05)
            continue
        rank, status, payload = queue.get()
        if status == "ok":
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        elif status == "port taken":  # no rank has run fn: stop them all, the caller starts them again
            for p in procs:
                p.kill()
                p.join(timeout=30)
            return None
        else:
            failed_at = failed_at or time.monotonic()
            errors[rank] = payload
    for p in procs:
        p.join(timeout=1 if errors else 30)
        if p.is_alive():
            p.kill()
            p.join(timeout=30)
    if errors:
        raise RuntimeError(
            "distributed worker failed:\n"
            + "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        )
    if len(results) != world_size:
        raise RuntimeError(
            f"run_warm: only {len(results)} of {world_size} ranks returned (exit codes {[p.exitcode for p in procs]})"
        )
    return [results[r] for r in range(world_size)]


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
