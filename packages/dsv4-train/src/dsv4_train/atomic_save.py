"""Atomic checkpoint saves: a checkpoint is written into a hidden sibling directory ``.iter_XXXXXXX.partial``,
completed with its run config and its manifest of checksums (:mod:`dsv4_train.ckpt_integrity`, written last),
flushed to disk, renamed to ``iter_XXXXXXX`` and only then named by ``checkpoints/latest`` (itself replaced
atomically). A save that fails part-way (a full disk, a write error, an interrupt) publishes nothing: the partial
directory is removed, ``latest`` keeps naming the previous checkpoint, and :class:`CheckpointSaveError` says why,
with the path. A save killed outright leaves its ``.partial`` directory, which the next save removes.

Every rank writes its own shard files; the ranks agree on success (one all-reduce) before rank 0 publishes, so no
rank goes on as if a failed save had succeeded.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from dsv4_train.ckpt_integrity import checkpoint_files, file_entries, write_manifest
from dsv4_train.lost_rank import kill_self, test_kill_point

PARTIAL_SUFFIX = ".partial"


class CheckpointSaveError(RuntimeError):
    """A save that failed: nothing was published, ``checkpoints/latest`` still names the previous checkpoint."""


def partial_dir(final: Path) -> Path:
    """The hidden sibling directory a checkpoint is written into before it is published as ``final``."""
    return final.parent / f".{final.name}{PARTIAL_SUFFIX}"


def fsync_dir(directory: Path) -> None:
    """Flush a directory's entries (renames and new files) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically: a reader sees the old or the new content, never a part."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _root_cause(error: BaseException) -> BaseException:
    """The innermost ``OSError`` behind ``error`` (through causes, contexts and the per-rank failures of torch's
    ``CheckpointException``), else ``error`` itself."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        if isinstance(e, CheckpointException):
            for failure in e.failures.values():
                todo.append(failure[0] if isinstance(failure, tuple) else failure)
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
    return error


class _WriterErrors(logging.Handler):
    """The errors megatron's shard writers log: their exception objects do not reach the caller (a worker's
    ``OSError`` comes back as a ``RuntimeError`` naming only its type), the log line has its text."""

    MARK = "encountered an error: "

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if self.MARK in text:
            self.messages.append(text.split(self.MARK, 1)[1].strip())


@contextlib.contextmanager
def writer_errors() -> Iterator[_WriterErrors]:
    """Collect the errors megatron's dist-checkpoint writers log inside the block."""
    handler = _WriterErrors()
    log = logging.getLogger("megatron.core.dist_checkpointing")
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)


def describe_failure(error: BaseException, logged: list[str] = ()) -> str:
    """One line for the cause of a failed save (``[Errno 28] No space left on device``, an interrupt, ...);
    ``logged``: what megatron's writers logged (:func:`writer_errors`), used when the exception lost it."""
    e = _root_cause(error)
    if not isinstance(e, OSError | KeyboardInterrupt) and logged:
        return logged[0].splitlines()[0][:300]
    if isinstance(e, OSError):
        name = errno.errorcode.get(e.errno, "") if e.errno else ""
        where = f": {e.filename}" if e.filename else ""
        return f"{name + ' ' if name else ''}{e.strerror or e}{where}"
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: {lines[-1][:300]}"


def _any_failed(failed: bool, group=None) -> bool:
    """Whether any rank of ``group`` failed (every rank calls this at the same point)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return failed
    flag = torch.tensor([1.0 if failed else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def _causes(mine: str | None) -> str:
    """Every rank's cause of a failed save, one line (every rank calls this: all of them agreed that it failed)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine or "unknown cause"
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    causes = [f"rank {r}: {c}" for r, c in enumerate(found) if c]
    return "; ".join(causes[:3]) + (f"; {len(causes) - 3} more ranks" if len(causes) > 3 else "")


def remove_partial_saves(checkpoints: Path) -> list[str]:
    """Delete the ``.iter_*.partial`` directories of saves that were killed; returns their names."""
    gone = []
    for p in sorted(Path(checkpoints).glob(f".iter_*{PARTIAL_SUFFIX}")):
        shutil.rmtree(p, ignore_errors=True)
        gone.append(p.name)
    return gone


def save_atomically(
    checkpoints: Path,
    step: int,
    write_shards: Callable[[Path], None],
    extra_files: dict[str, str],
    *,
    rank: int,
) -> Path:
    """Write the checkpoint of ``step`` as ``checkpoints/iter_{step:07d}`` and point ``checkpoints/latest`` at it.

    ``write_shards(directory)`` writes the sharded state (every rank, collectively); ``extra_files``
    (name -> text) are written by rank 0 next to them. :class:`CheckpointSaveError` on every rank when any rank
    failed: nothing is published and the partial directory is removed (a ``KeyboardInterrupt`` is re-raised
    after the clean-up)."""
    checkpoints = Path(checkpoints)
    final = checkpoints / f"iter_{step:07d}"
    tmp = partial_dir(final)
    latest = checkpoints / "latest"
    error: BaseException | None = None
    published, logged = False, _WriterErrors()
    rank_of_world = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        try:
            checkpoints.mkdir(parents=True, exist_ok=True)
            remove_partial_saves(checkpoints)
            tmp.mkdir()
        except OSError as e:
            error = e
    try:
        if not _any_failed(error is not None):
            try:
                with writer_errors() as logged:
                    write_shards(tmp)
            except (Exception, KeyboardInterrupt, CheckpointException) as e:
                error = e
            if test_kill_point(rank_of_world, "save") == step:  # the fault tests' hook (dsv4_train.lost_rank)
                kill_self()
            if not _any_failed(error is not None):
                # each rank hashes the shard files it wrote (``__{rank}_*``); rank 0 the rest
                mine = f"__{rank_of_world}_"
                try:
                    entries = file_entries(tmp, [n for n in checkpoint_files(tmp) if n.startswith(mine)])
                except OSError as e:
                    error, entries = e, {}
                if not _any_failed(error is not None):
                    gathered = [entries]
                    if dist.is_initialized() and dist.get_world_size() > 1:
                        gathered = [None] * dist.get_world_size()
                        dist.all_gather_object(gathered, entries)
                    if rank == 0:
                        try:
                            _publish(tmp, final, latest, extra_files, gathered)
                        except (Exception, KeyboardInterrupt) as e:
                            error = e
                    published = not _any_failed(error is not None)  # the others wait for the publication
    finally:
        # whatever failed (also a collective with a lost rank): no partial directory is left behind
        if rank == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if published:
        return final
    if isinstance(error, KeyboardInterrupt):
        raise error
    if latest.is_file():  # every suggested command works: --resume needs a checkpoint, --resume auto does not
        kept, then = f"{latest} still names {latest.read_text().strip()}", "continue with --resume"
    else:
        kept, then = "there is no earlier checkpoint", "start again with --resume auto"
    # this rank's cause: its exception, else what its shard writers logged (megatron raises on the coordinator only)
    mine = describe_failure(error, logged.messages) if error is not None else None
    if isinstance(error, CheckpointException) and rank_of_world not in error.failures:
        mine = None  # the coordinator's report of other ranks' write failures: they name their own causes
    cause = _causes(mine or (logged.messages[0].splitlines()[0][:300] if logged.messages else None))
    raise CheckpointSaveError(
        f"saving the checkpoint of step {step} into {final} failed ({cause}); nothing was published ({kept}): "
        f"fix the cause (e.g. free disk space) and {then}"
    ) from error


def _publish(tmp: Path, final: Path, latest: Path, extra_files: dict[str, str], gathered: list[dict]) -> None:
    """Rank 0: the extra files, the manifest (last), fsync, rename ``tmp`` -> ``final``, then ``latest``."""
    for name, text in extra_files.items():
        with open(tmp / name, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    entries: dict[str, dict] = {}
    for part in gathered:
        entries.update(part)
    entries.update(file_entries(tmp, [n for n in checkpoint_files(tmp) if n not in entries]))
    write_manifest(tmp, entries)
    fsync_dir(tmp)
    old = None
    if final.exists():  # a checkpoint of this step from an earlier run (latest names an older one): replaced
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    write_file_atomically(latest, final.name)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
