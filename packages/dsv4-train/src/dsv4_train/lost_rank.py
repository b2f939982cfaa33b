"""Losing a rank of a multi-process ``dsv4 train`` run: the survivors stop with one line naming it.

Each rank of a run with several processes runs a heartbeat thread (:class:`RankWatch`) that counts up a key of its
own in the rendezvous store (torchrun's agent hosts it, so it outlives any worker) once a second. When a step or a
save fails on a rank (gloo: the peer's connection closed, at once; NCCL or a stuck peer: the collective reaches
``--dist-timeout``), that rank reads every heartbeat twice, :data:`PROBE_BEATS` beats apart: the ranks whose
count did not move are lost, and :meth:`RankWatch.explain` gives the :class:`RankLost` error that names them (the
rank prints it at once, since torchrun's agent terminates the survivors once it notices the lost worker).

Test hook (only for the fault tests, documented in the README): ``DSV4_TRAIN_TEST_KILL_RANK_AT_STEP=R:N`` makes
rank ``R`` send itself SIGKILL at the start of step ``N`` (1-based, as the progress lines count: the others then
wait for it in that step's gradient reduction); ``R:N:save`` in the checkpoint save of step ``N``, after its shard
files are written and before the ranks agree to publish them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

#: seconds between two heartbeats of a rank
HEARTBEAT_S = 1.0
#: heartbeats a rank may miss before it counts as lost
PROBE_BEATS = 3
#: seconds a rank's heartbeat may take to connect to the rendezvous store (a loaded machine can take several)
CONNECT_TIMEOUT_S = 60.0
#: the test hook: ``R:N`` = rank R kills itself (SIGKILL) at the start of step N, ``R:N:save`` in its save
KILL_HOOK_ENV = "DSV4_TRAIN_TEST_KILL_RANK_AT_STEP"
KILL_POINTS = ("step", "save")


class RankLost(RuntimeError):
    """A rank of the run stopped responding (or a collective timed out); already printed by the rank that found it."""


def test_kill_point(rank: int, point: str) -> int | None:
    """The step at whose ``point`` (``"step"``: its start, ``"save"``: its checkpoint save) :data:`KILL_HOOK_ENV`
    asks this rank to kill itself (``None``: never)."""
    spec = os.environ.get(KILL_HOOK_ENV)
    if not spec:
        return None
    parts = spec.split(":")
    try:
        r, n = int(parts[0]), int(parts[1])
        where = parts[2] if len(parts) == 3 else "step"
        if len(parts) > 3 or where not in KILL_POINTS:
            raise ValueError(where)
    except (ValueError, IndexError) as e:
        raise ValueError(f"{KILL_HOOK_ENV}={spec!r}: expected RANK:STEP or RANK:STEP:save, e.g. 1:3") from e
    return n if r == rank and where == point else None


def kill_self() -> None:
    """SIGKILL this process (the test hook: no clean-up, like a crashed node)."""
    os.kill(os.getpid(), signal.SIGKILL)


class RankWatch:
    """The heartbeat of this rank in the rendezvous store and the probe of the others' (world > 1)."""

    def __init__(self, rank: int, world: int, *, interval: float = HEARTBEAT_S) -> None:
        self.rank, self.world, self.interval = rank, world, interval
        run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        self._prefix = (
            f"dsv4_heartbeat/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{os.getpid()}/"
        )
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        self._store = None
        if host and port:
            # The heartbeat only names a lost rank; it must never be what stops a run. On a loaded machine the
            # connection and the first set could take longer than the probe's timeout (a heartbeat that raised
            # here ended that rank before its first step, and torchrun then SIGTERMed the others outside the
            # trainer's handler): connect with CONNECT_TIMEOUT_S, and run without a heartbeat when that fails.
            try:
                store = dist.TCPStore(
                    host, int(port), is_master=False, timeout=timedelta(seconds=CONNECT_TIMEOUT_S)
                )
                # one key per rank, shared by all: the ranks learn each other's key names through the store
                store.set(f"dsv4_heartbeat/key/{run}/{rank}", self._prefix)
                store.set_timeout(
                    timedelta(seconds=max(5.0, 5 * interval))
                )  # the beats and the probe's reads
                self._store = store
            except Exception as e:  # no store: the run goes on; a failure is then reported as it is
                print(
                    f"dsv4 train: note: rank {rank}: no heartbeat ({e}); a lost rank will not be named",
                    file=sys.stderr,
                    flush=True,
                )
        self._lock = threading.Lock()  # the beat and the probe share the store client
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"dsv4-heartbeat-{rank}", daemon=True)
        if self._store is not None:
            self._thread.start()

    def _beat(self) -> None:
        key = self._prefix + "beats"
        while not self._stop.is_set():
            try:
                with self._lock:
                    self._store.add(key, 1)
            except (
                Exception
            ):  # a slow store (a loaded machine) or one that is gone: try again at the next beat;
                pass  # a beat that stopped for good would make the probe name this live rank as lost
            self._stop.wait(self.interval)

    def _counts(self) -> list[int]:
        run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        counts = []
        for r in range(self.world):
            try:
                with self._lock:
                    prefix = self._store.get(f"dsv4_heartbeat/key/{run}/{r}").decode()
                    counts.append(self._store.add(prefix + "beats", 0))
            except Exception:  # no key yet (died before its first beat) or unreadable
                counts.append(-1)
        return counts

    def lost_ranks(self) -> list[int] | None:
        """The ranks whose heartbeat stopped (``None`` when the store cannot be reached)."""
        if self._store is None:
            return None
        try:
            before = self._counts()
            time.sleep(PROBE_BEATS * self.interval)
            after = self._counts()
        except Exception:
            return None
        return [r for r in range(self.world) if r != self.rank and (after[r] == before[r] or after[r] < 0)]

    def explain(self, error: BaseException, *, step: int, timeout_s: float, then: str) -> RankLost | None:
        """The :class:`RankLost` for ``error`` raised during step ``step`` (printed now, on stderr; ``then``: what
        the checkpoints hold and how to go on), or ``None`` when every rank still beats and ``error`` is no timeout
        (then it is not a lost rank's doing)."""
        lost = self.lost_ranks()
        if lost:
            names = ", ".join(str(r) for r in lost)
            what = (
                f"rank {names} of {self.world} stopped responding during step {step} (its process ended or hangs): "
                f"rank {self.rank} stops too"
            )
        elif "timed out" in str(error).lower() or "timeout" in type(error).__name__.lower():
            what = (
                f"a collective waited longer than --dist-timeout {timeout_s:g} s during step {step} while every rank "
                f"is alive (one is stuck, or the ranks run different code): rank {self.rank} stops"
            )
        else:
            return None
        message = f"{what}; {then}"
        print(f"dsv4 train: error: {message}", file=sys.stderr, flush=True)
        return RankLost(message)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval + 1)
