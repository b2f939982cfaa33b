"""Checksums of ``dsv4 train`` checkpoints: every file of an ``iter_XXXXXXX`` directory is listed with its size and
SHA-256 digest in ``dsv4_manifest.json``, written last (:mod:`dsv4_train.atomic_save`), and checked before the
checkpoint is loaded (``--resume``, ``--init-from``, ``dsv4 convert`` / ``dsv4 generate`` of a train run).

A truncated, altered or missing file gives one line naming the file and the checkpoint instead of a load that
fails deep inside megatron or, worse, succeeds with different numbers. Checkpoints written before the manifest
existed load unverified with a note; a checkpoint written with a manifest whose manifest is gone is refused (its
common state records :data:`MANIFEST_MARKER`).

Manifest format (JSON)::

    {"format": "dsv4-checkpoint-manifest", "version": 1, "hash": "sha256",
     "files": {"__0_0.distcp": {"bytes": 12917490, "sha256": "<64 hex digits>"}, ".metadata": {...}, ...}}

``files`` holds every file of the directory except the manifest itself (paths relative to it). With several
processes each one hashes its own share of the files (:func:`verify_checkpoint`: ``share=(rank, world)``); every
process checks every file's size.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch.distributed as dist
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException

MANIFEST_FILE = "dsv4_manifest.json"
MANIFEST_FORMAT = "dsv4-checkpoint-manifest"
MANIFEST_VERSION = 1
HASH_NAME = "sha256"
#: common-state key of every checkpoint saved with a manifest: its absence is noticed
MANIFEST_MARKER = "dsv4_manifest"


class CheckpointDamaged(ValueError):
    """A checkpoint whose files do not match its manifest (or whose manifest is missing or unreadable)."""


def file_digest(path: Path) -> str:
    """SHA-256 of the file ``path`` (hex; hashlib uses the CPU's SHA instructions where it has them: about
    0.7 GB/s per process on a loaded 2-core x86 machine, faster than BLAKE2b there)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def checkpoint_files(directory: Path) -> list[str]:
    """The files of a checkpoint directory (relative paths, sorted), the manifest excluded."""
    directory = Path(directory)
    return sorted(
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST_FILE and not p.name.startswith(f".{MANIFEST_FILE}")
    )


def file_entries(directory: Path, names: list[str]) -> dict[str, dict]:
    """``{name: {"bytes": size, "sha256": digest}}`` of ``names`` in ``directory``."""
    return {
        n: {"bytes": (Path(directory) / n).stat().st_size, "sha256": file_digest(Path(directory) / n)}
        for n in names
    }


def write_manifest(directory: Path, files: dict[str, dict]) -> Path:
    """Write ``directory/dsv4_manifest.json`` listing ``files`` (durably: a temporary file, fsync, rename)."""
    path = Path(directory) / MANIFEST_FILE
    doc = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "hash": HASH_NAME, "files": files}
    tmp = path.with_name(f".{MANIFEST_FILE}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_manifest(path: Path) -> dict[str, dict]:
    """The ``files`` of the manifest of checkpoint ``path`` (:class:`CheckpointDamaged` when it is unreadable)."""
    manifest = Path(path) / MANIFEST_FILE
    try:
        doc = json.loads(manifest.read_text())
        if doc.get("format") != MANIFEST_FORMAT or doc.get("hash") != HASH_NAME:
            raise ValueError(f"not a {MANIFEST_FORMAT} with {HASH_NAME} digests")
        if doc.get("version") != MANIFEST_VERSION:
            raise ValueError(
                f"version {doc.get('version')!r}; this dsv4-train reads version {MANIFEST_VERSION}"
            )
        files = doc["files"]
        for name, entry in files.items():
            if not isinstance(entry.get("bytes"), int) or not isinstance(entry.get("sha256"), str):
                raise ValueError(f"entry {name!r} lacks bytes/sha256")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointDamaged(f"checkpoint {path}: its {MANIFEST_FILE} cannot be read ({e})") from e
    return files


def expects_manifest(path: Path) -> bool:
    """Whether checkpoint ``path`` was saved with a manifest (its common state holds :data:`MANIFEST_MARKER`);
    ``False`` when the common state cannot be read (the load then reports that)."""
    try:
        common = dist_checkpointing.load_common_state_dict(str(path))
    except (
        Exception,
        CheckpointException,
    ):  # megatron raises whatever it meets; CheckpointException: BaseException
        return False
    return bool(common.get(MANIFEST_MARKER))


def verify_checkpoint(path: Path, *, share: tuple[int, int] = (0, 1)) -> bool:
    """Check the checkpoint directory ``path`` against its manifest: every listed file present with its size,
    and the digests of this process's ``share = (rank, world)`` of the files (file ``i`` of the sorted list when
    ``i % world == rank``). ``True`` when verified; ``False`` for a checkpoint written before manifests existed
    (the caller notes that it loads unverified); :class:`CheckpointDamaged` (a ``ValueError``, one line naming
    the file and the checkpoint) otherwise."""
    path = Path(path)
    if not (path / MANIFEST_FILE).is_file():
        if expects_manifest(path):
            raise CheckpointDamaged(
                f"checkpoint {path}: its {MANIFEST_FILE} is missing (the checkpoint was saved with one: its files "
                "cannot be checked)"
            )
        return False
    files = read_manifest(path)
    rank, world = share
    for i, (name, entry) in enumerate(sorted(files.items())):
        f = path / name
        if not f.is_file():
            raise CheckpointDamaged(f"checkpoint {path}: its file {name} is missing")
        size = f.stat().st_size
        if size != entry["bytes"]:
            what = "truncated" if size < entry["bytes"] else "longer than saved"
            raise CheckpointDamaged(
                f"checkpoint {path}: its file {name} is {what} ({size:,} bytes; the manifest records "
                f"{entry['bytes']:,})"
            )
        if i % world == rank and file_digest(f) != entry["sha256"]:
            raise CheckpointDamaged(
                f"checkpoint {path}: its file {name} was altered (its {HASH_NAME} digest differs from the one in "
                f"{MANIFEST_FILE})"
            )
    return True


def env_share() -> tuple[int, int]:
    """``(rank, world)`` of this process from torchrun's environment (``(0, 1)`` without it): the share of the
    files it hashes before the process group exists."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def unverified_note(path: Path) -> str:
    return (
        f"checkpoint {path} has no {MANIFEST_FILE} (saved before dsv4 train recorded checksums, or not by dsv4 "
        "train): loading it unverified"
    )


def _agree_on_damage(message: str | None) -> str | None:
    """The first damage any rank found (every rank of the default group calls this at the same point)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return message
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, message)
    return next((m for m in found if m), None)


def _note(line: str) -> None:
    print(f"dsv4 train: note: {line}", flush=True)


def verify_loaded(path: Path, *, what: str, remedy: str | None = None, note=_note) -> bool:
    """:func:`verify_checkpoint` of the checkpoint ``path`` that ``what`` (``--init-from X``, ``dsv4 convert``)
    is about to load, shared over the ranks of the default process group when there is one (every rank raises
    the same ``ValueError``); ``note`` (rank 0) receives the line for a checkpoint without manifest.
    ``remedy``: what the user should do (default: load another checkpoint)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    try:
        verified, damage = verify_checkpoint(path, share=(rank, world)), None
    except CheckpointDamaged as e:
        verified, damage = True, str(e)
    damage = _agree_on_damage(damage)
    if damage:
        fix = remedy or "load another checkpoint (e.g. an older iter_XXXXXXX of that run)"
        raise CheckpointDamaged(f"{what}: {damage}; it cannot be loaded: {fix}")
    if not verified and rank == 0 and note is not None:
        note(unverified_note(path))
    return verified


def verify_resume(path: Path) -> bool:
    """Before a resume builds anything (no process group yet): :func:`verify_checkpoint` of ``path`` with this
    process's share from torchrun's environment (:func:`env_share`). ``ValueError`` naming the file and what to
    do; ``False`` for a checkpoint without manifest."""
    path = Path(path)
    try:
        return verify_checkpoint(path, share=env_share())
    except CheckpointDamaged as e:
        raise CheckpointDamaged(
            f"--resume: {e}; write the name of an older iter_XXXXXXX into {path.parent / 'latest'} and resume "
            "again, or start a new run with --overwrite"
        ) from None
