"""Writing megatron-core 0.19.2 ``torch_dist`` checkpoints one tensor box at a time, without a process group.

The format, as ``megatron.core.dist_checkpointing.save`` writes it (torch distributed checkpoint, DCP):

* ``__{rank}_0.distcp``: one file per saving rank, a concatenation of items. A tensor item is ``torch.save`` of one
  contiguous box (a chunk of a global tensor at a global offset); a ``ShardedObject`` item is ``torch.save`` of the
  list of its data, stored under its unique key ``KEY/shard_{offset}_{global shape}``. The common (non-sharded)
  state is the object ``common_state`` (``common_state/shard_0_1``).
* ``.metadata``: a pickled ``torch.distributed.checkpoint.metadata.Metadata``: per key its global size, dtype
  and chunk list (``TensorStorageMetadata``; objects: ``BytesStorageMetadata``), and per item
  ``MetadataIndex(key, offset) -> _StorageInfo(file, byte offset, length)``.
* ``metadata.json``: megatron's ``{"sharded_backend": "torch_dist", "sharded_backend_version": 1}``.

A reader loads any box of a key from the chunks that overlap it, so the chunks may be smaller than what a rank
loads (one routed expert's ``w1`` is one chunk here); which file holds a chunk only decides what each rank reads.
"""

from __future__ import annotations

import os
import pickle
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.mapping import ShardedObject
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

METADATA_FILE = ".metadata"


def distcp_name(rank: int) -> str:
    """The file rank ``rank`` writes (megatron's writer names it so, one file per rank)."""
    return f"__{rank}_0.distcp"


def common_state_key() -> str:
    """The unique key of megatron's common-state object."""
    return ShardedObject("common_state", None, (1,), (0,)).unique_key


@dataclass(frozen=True)
class StoredItem:
    """Where one item went: ``key`` (unique key for objects), the box offset (``None`` for objects), file, bytes."""

    key: str
    offset: tuple[int, ...] | None
    file: str
    start: int
    length: int

    def to_json(self) -> list:
        return [
            self.key,
            None if self.offset is None else list(self.offset),
            self.file,
            self.start,
            self.length,
        ]

    @classmethod
    def from_json(cls, row: list) -> StoredItem:
        key, offset, file, start, length = row
        return cls(key, None if offset is None else tuple(offset), file, start, length)


class DistcpWriter:
    """Appends items to one ``__{rank}_0.distcp`` file; :meth:`close` flushes it to disk."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._f = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        self.stored: list[StoredItem] = []

    def _append(self, key: str, offset: tuple[int, ...] | None, obj: Any) -> None:
        start = self._f.tell()
        torch.save(obj, self._f)
        self.stored.append(StoredItem(key, offset, self.path.name, start, self._f.tell() - start))

    def add_tensor(self, key: str, offset: tuple[int, ...], box: torch.Tensor) -> None:
        """The box of ``key`` at global ``offset`` (saved alone: a view's whole storage is never written)."""
        if box.is_contiguous() and box.untyped_storage().nbytes() == box.nbytes and box.storage_offset() == 0:
            self._append(key, offset, box)
        else:
            self._append(key, offset, box.contiguous().clone())

    def add_object(self, unique_key: str, data: Any) -> None:
        """A ``ShardedObject`` item (its data list, as megatron saves it)."""
        self._append(unique_key, None, [data])

    def close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        self._f.close()


@dataclass(frozen=True)
class TensorSpec:
    """A checkpoint tensor: global shape, dtype and the boxes it is stored as (``(offset, shape)`` each)."""

    dtype: torch.dtype
    global_shape: tuple[int, ...]
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


def write_metadata(
    directory: Path, tensors: dict[str, TensorSpec], objects: list[str], stored: list[StoredItem]
) -> None:
    """``.metadata`` and ``metadata.json`` of the checkpoint in ``directory``: every tensor's chunks and every
    object must have been stored (``ValueError`` naming the first one missing)."""
    directory = Path(directory)
    where = {(s.key, s.offset): s for s in stored}
    sd_meta: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for key, spec in tensors.items():
        chunks = []
        for offset, shape in spec.chunks:
            s = where.get((key, tuple(offset)))
            if s is None:
                raise ValueError(f"{directory}: chunk {key} at {offset} was never written")
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(shape)))
            storage[MetadataIndex(key, torch.Size(offset))] = _StorageInfo(s.file, s.start, s.length)
        props = TensorProperties(dtype=spec.dtype)
        sd_meta[key] = TensorStorageMetadata(props, torch.Size(spec.global_shape), chunks)
    for key in objects:
        s = where.get((key, None))
        if s is None:
            raise ValueError(f"{directory}: object {key} was never written")
        sd_meta[key] = BytesStorageMetadata()
        storage[MetadataIndex(key)] = _StorageInfo(s.file, s.start, s.length)
    meta = Metadata(
        state_dict_metadata=sd_meta,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=str(directory), save_id=str(uuid.uuid4())),
        version=CURRENT_DCP_VERSION,
    )
    tmp = directory / f"{METADATA_FILE}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / METADATA_FILE)
    save_config(CheckpointingConfig("torch_dist", 1), str(directory))
