"""The content identity of a run's training data, recorded with every checkpoint and checked on ``--resume``.

A checkpoint's data position counts global batches of one sample stream; replacing a ``--data`` file's contents
under the same path would make a resumed run continue at that position of *another* stream. So every checkpoint
directory holds :data:`DATA_IDENTITY_FILE` (JSON): per file the run's training stream depends on

- every file of every ``--data`` source (a directory's files as the reader finds them), the ``lengths=`` file of
  ``--data mock:...`` and the ``--tokenizer`` file,
- its resolved path, size in bytes, modification time (ns) and a SHA-256 content digest: of the whole file up to
  :data:`FULL_HASH_LIMIT` bytes; of a larger file, of its size and :data:`SAMPLE_BLOCKS` blocks of
  :data:`SAMPLE_BYTES` bytes (the first, the last and the rest evenly spaced) — measured on a 1 GiB file: about
  0.6 s for a whole-file digest, about 0.02 s for the sampled one (packages/dsv4-train/README.md),

as recorded when the run started reading them. ``--resume`` recomputes it (with the scheme the checkpoint
recorded) and refuses, in one line naming the file and what changed, when a file is new, gone, of another size or
of another digest; the way out is to restore the data or to start a new run from the checkpoint's weights
(``--init-from``). A modification time that changed while size and digest match is accepted: a whole-file digest
proves the content is the same (a copy, ``touch``); a sampled one cannot see an edit that keeps the size and misses
the sampled blocks, so the run says so in a note. The evaluation data (``--eval-data``) do not enter the training
stream and are not recorded. Checkpoints written before this file existed resume without the check (with a note).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dsv4_train.ckpt_integrity import file_digest as whole_file_digest
from dsv4_train.config import TrainConfig
from dsv4_train.mock_data import check_mock_data
from thd_packing.text_sources import resolve_text_files

#: the file a checkpoint directory records its run's data identity in
DATA_IDENTITY_FILE = "data_identity.json"
#: files up to this size get a digest of their whole content
FULL_HASH_LIMIT = 64 << 20
#: larger files: this many blocks (first, last, the rest evenly spaced) of SAMPLE_BYTES are digested with the size
SAMPLE_BLOCKS = 16
SAMPLE_BYTES = 1 << 20
#: the version of the file's format (and of the digest scheme); a newer version is refused with a clear message
FORMAT_VERSION = 1
#: changed files listed one by one in the refusal (the rest are counted)
LIST_LIMIT = 3


@dataclass(frozen=True)
class DigestScheme:
    """How file contents are digested: whole files up to ``full_limit`` bytes, else ``blocks`` blocks of
    ``block_bytes`` with the size."""

    full_limit: int = FULL_HASH_LIMIT
    blocks: int = SAMPLE_BLOCKS
    block_bytes: int = SAMPLE_BYTES

    def sampled(self, size: int) -> bool:
        return size > self.full_limit


@dataclass(frozen=True)
class FileIdentity:
    """One file the training stream depends on: ``role`` is the flag that names it (``--data``, ``--tokenizer``,
    ``--data mock lengths``); ``digest`` the hex SHA-256 of the whole file or (``sampled``) of size + blocks."""

    role: str
    path: str
    size: int
    mtime_ns: int
    digest: str
    sampled: bool


def sample_offsets(size: int, scheme: DigestScheme) -> list[int]:
    """Start offsets of the blocks a sampled digest reads: the first and the last block and the rest evenly
    spaced between them (``size`` > ``scheme.full_limit`` >= ``scheme.blocks * scheme.block_bytes``)."""
    last = max(size - scheme.block_bytes, 0)
    n = max(scheme.blocks, 2)
    return sorted({round(i * last / (n - 1)) for i in range(n)})


def file_digest(path: Path, size: int, scheme: DigestScheme) -> str:
    """Hex SHA-256 of ``path``'s whole content, or (``scheme.sampled(size)``) of its size (8 bytes, little
    endian) followed by the blocks at :func:`sample_offsets`."""
    if not scheme.sampled(size):
        return whole_file_digest(path)
    h = hashlib.sha256()
    h.update(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        for offset in sample_offsets(size, scheme):
            f.seek(offset)
            h.update(f.read(scheme.block_bytes))
    return h.hexdigest()


def file_identity(path: Path, role: str, scheme: DigestScheme) -> FileIdentity:
    """The identity of one file (``ValueError`` naming it and the flag when it cannot be read)."""
    resolved = Path(path).resolve()
    try:
        st = os.stat(resolved)
        digest = file_digest(resolved, st.st_size, scheme)
    except OSError as e:
        raise ValueError(f"{role} file {path} cannot be read ({e.strerror or e})") from e
    return FileIdentity(role, str(resolved), st.st_size, st.st_mtime_ns, digest, scheme.sampled(st.st_size))


def stream_files(tc: TrainConfig) -> list[tuple[str, Path]]:
    """``(role, path)`` of every file the training stream of ``tc`` is read from (module docstring); the default
    corpus is embedded in the package and has none."""
    files: list[tuple[str, Path]] = []
    spec = check_mock_data(tc)
    if spec is not None:
        if spec.lengths is not None:
            files.append(("--data mock lengths", Path(spec.lengths)))
    elif tc.data.sources:
        files += [("--data", f) for f in resolve_text_files(list(tc.data.sources))]
    if tc.data.tokenizer is not None:
        files.append(("--tokenizer", Path(tc.data.tokenizer)))
    return files


def data_identity(tc: TrainConfig, scheme: DigestScheme | None = None) -> dict[str, Any]:
    """The data identity of ``tc``'s training stream as :data:`DATA_IDENTITY_FILE` holds it."""
    scheme = scheme or DigestScheme()
    return {
        "version": FORMAT_VERSION,
        "scheme": asdict(scheme),
        "files": [asdict(file_identity(p, role, scheme)) for role, p in stream_files(tc)],
    }


def write_data_identity(directory: Path, identity: dict[str, Any]) -> None:
    """Write ``identity`` into ``directory / DATA_IDENTITY_FILE``."""
    (Path(directory) / DATA_IDENTITY_FILE).write_text(identity_text(identity))


def identity_text(identity: dict[str, Any]) -> str:
    """The text of :data:`DATA_IDENTITY_FILE` for ``identity`` (what a checkpoint save writes)."""
    return json.dumps(identity, indent=1) + "\n"


def read_data_identity(checkpoint: Path) -> dict[str, Any] | None:
    """The identity recorded in the checkpoint directory ``checkpoint`` (``None`` for checkpoints written before
    it was recorded; ``ValueError`` naming the file when it cannot be read)."""
    path = Path(checkpoint) / DATA_IDENTITY_FILE
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
        version = saved["version"]
        scheme = DigestScheme(**saved["scheme"])
        files = [FileIdentity(**f) for f in saved["files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path} cannot be read ({type(e).__name__}: {e}): restore it, or delete it to resume without "
            "checking the data"
        ) from e
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format version {version!r}; this dsv4-train reads version {FORMAT_VERSION}: resume with "
            "the dsv4-train that wrote it, or delete the file to resume without checking the data"
        )
    return {"version": version, "scheme": scheme, "files": files}


def _describe(old: FileIdentity, new: FileIdentity | None) -> str | None:
    """What changed about one recorded file (``None``: nothing that matters)."""
    if new is None:
        return f"{old.role} file {old.path} is gone"
    if old.size != new.size:
        return f"{old.role} file {old.path} changed: {old.size:,} -> {new.size:,} bytes"
    if old.digest != new.digest:
        how = "sampled content" if old.sampled else "content"
        return f"{old.role} file {old.path} changed: same size ({new.size:,} bytes), other {how} (SHA-256)"
    return None


def data_changes(saved: dict[str, Any], tc: TrainConfig) -> tuple[list[str], list[str], dict[str, Any]]:
    """``(changes, notes, current)``: what differs between the recorded identity ``saved`` (from
    :func:`read_data_identity`) and ``tc``'s data now, one phrase each; notes on files whose modification time
    changed while their content matches (a sampled digest says it could miss an edit); and the current identity,
    computed with the recorded scheme (what the resumed run records)."""
    scheme: DigestScheme = saved["scheme"]
    current = data_identity(tc, scheme)
    now = {(f["role"], f["path"]): FileIdentity(**f) for f in current["files"]}
    then = {(f.role, f.path): f for f in saved["files"]}
    changes, notes = [], []
    for key, old in then.items():
        change = _describe(old, now.get(key))
        if change:
            changes.append(change)
        elif now[key].mtime_ns != old.mtime_ns and old.sampled:
            notes.append(
                f"{old.role} file {old.path} was modified since the checkpoint's run but its size and "
                f"{scheme.blocks} sampled blocks match; resuming (an edit that keeps the size and misses the "
                "sampled blocks cannot be seen)"
            )
    changes += [f"{role} file {path} is new" for role, path in now if (role, path) not in then]
    return changes, notes, current


def check_same_data(checkpoint: Path, tc: TrainConfig) -> tuple[dict[str, Any], list[str]]:
    """``(identity, notes)`` for a resume of ``tc`` from ``checkpoint``: the identity the resumed run records and
    lines to print; ``ValueError`` (one line naming the files and what changed, and what to do) when the training
    data differ from what the checkpoint's run read."""
    saved = read_data_identity(checkpoint)
    if saved is None:
        return data_identity(tc), [
            f"dsv4 train: note: {checkpoint} records no data identity (written by an older dsv4-train): the "
            "--data files are not checked against the checkpoint's run"
        ]
    changes, notes, current = data_changes(saved, tc)
    if changes:
        shown = "; ".join(changes[:LIST_LIMIT])
        more = f"; and {len(changes) - LIST_LIMIT} more" if len(changes) > LIST_LIMIT else ""
        raise ValueError(
            f"--resume from {checkpoint}: the training data differ from the checkpoint's run ({shown}{more}), "
            "so its data position would continue another sample stream: restore the data the checkpoint's run "
            f"read, or start a new run on these data from its weights with --init-from {checkpoint} --out NEW_DIR "
            "(optimizer, schedule and data position start fresh)"
        )
    return current, [f"dsv4 train: note: {n}" for n in notes]


__all__ = [
    "DATA_IDENTITY_FILE",
    "DigestScheme",
    "FileIdentity",
    "check_same_data",
    "data_changes",
    "data_identity",
    "file_digest",
    "identity_text",
    "read_data_identity",
    "sample_offsets",
    "stream_files",
    "write_data_identity",
]
