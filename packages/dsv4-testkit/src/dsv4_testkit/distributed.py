"""A gloo multi-process runner on loopback for distributed CPU tests.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initialises a gloo process group on
127.0.0.1 in each, calls ``fn(rank, world_size, *args)`` and returns the list of per-rank return values (which
must be serialisable by ``torch.save``; tensors are fine). An exception on any rank is re-raised in the parent with that rank's
traceback. Workers never touch anything but the loopback address. The port is picked free just before the spawn;
when another process takes it in between (rank 0's store fails with ``EADDRINUSE``), the workers are stopped and
started again on a new port, up to :data:`PORT_ATTEMPTS` times (``fn`` has not run on any rank then). Once one
rank has failed, the others get :data:`FAILURE_GRACE_S` seconds to report (their own error, or their result) and are
then stopped: a rank left waiting in a collective for the failed one would otherwise hold the caller until
``timeout``.
"""

from __future__ import annotations

import io
import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: spawns of one run_distributed call whose rendezvous port another process took first
PORT_ATTEMPTS = 3
#: seconds the other ranks get to report once one rank has failed, before they are stopped
FAILURE_GRACE_S = 10.0


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, env: dict | None, fn: Callable, args: tuple, queue
) -> None:
    if env is not None:  # a forked worker: the caller's environment at the call (its server's is older)
        os.environ.clear()
        os.environ.update(env)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
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
        # Serialise through torch.save: tensors put on a multiprocessing queue live in the worker's shared memory,
        # which is gone once the worker exits.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report every failure to the parent, then exit
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0, context=None
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results in order.

    ``fn`` must be a module-level function (it is pickled into spawned processes). ``context``: the multiprocessing
    context that starts the workers (default ``spawn``: fresh interpreters). A ``forkserver`` context whose server
    preloaded the heavy imports (``set_forkserver_preload``) starts them in a fraction of the time; its workers get
    the caller's environment as it is at the call.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    for _ in range(PORT_ATTEMPTS):
        results = _spawn(fn, world_size, args, timeout, context or mp.get_context("spawn"))
        if results is not None:
            return results
    raise RuntimeError(
        f"run_distributed: {PORT_ATTEMPTS} rendezvous ports in a row were taken by other processes"
    )


def _spawn(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float, ctx) -> list[Any] | None:
    """One start of the workers on a fresh port; ``None`` when rank 0 found the port taken (workers stopped)."""
    queue = ctx.SimpleQueue()
    port = free_port()
    env = None if ctx.get_start_method() == "spawn" else dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, env, fn, args, queue), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}  # rank -> traceback
    failed_at = 0.0  # when the first rank reported a failure
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        if time.monotonic() > deadline:
            break
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
        elif status == "port taken":  # no rank has run fn: stop them all, the caller spawns again
            for p in procs:
                p.kill()
                p.join(timeout=30)
            return None
        else:
            if not errors:
                failed_at = time.monotonic()
            errors[rank] = payload
    for p in procs:
        p.join(timeout=1 if errors else 30)
        if p.is_alive():
            p.kill()
            p.join(timeout=30)
    if errors:
        silent = sorted(set(range(world_size)) - set(results) - set(errors))
        stopped = (
            f" (ranks {silent} stopped {FAILURE_GRACE_S:.0f} s after the first failure)" if silent else ""
        )
        raise RuntimeError(
            f"distributed worker failed{stopped}:\n"
            + "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        )
    if len(results) != world_size:
        raise RuntimeError(
            f"only {len(results)} of {world_size} ranks returned (exit codes {[p.exitcode for p in procs]})"
        )
    return [results[r] for r in range(world_size)]
