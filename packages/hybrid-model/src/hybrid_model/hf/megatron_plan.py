"""The plan of a streamed HF -> megatron conversion: which source tensor goes, as which box of which checkpoint
key, into which rank's file of the target layout (:mod:`hybrid_model.hf.megatron_layout`).

The checkpoint's keys, global shapes, dtypes and objects come from the single-stage model of the checkpoint's
config built on the meta device (no memory): they are what ``DSv4Model.sharded_state_dict()`` declares, the same
at every PP / VPP / EP layout (global layer numbers, global expert axis). Each official tensor is one box
(:func:`~hybrid_model.hf.weights.official_placements`: a routed expert's ``w1`` / ``w3`` / ``w2`` is one
expert's slice of the fused bank), so a job never holds more than one source tensor. Under ``--tp N`` a TP-split
tensor's box is cut at the TP shard edges (:mod:`hybrid_model.hf.megatron_tp`: the partition axes of the same meta
model, marked as ``dsv4 train --tp N`` marks it): each TP rank's file gets its slice, read as only that box of the
source tensor (:mod:`hybrid_model.hf.source_box`: a ``--tp N`` conversion reads each source byte once; a piece's
``read_bytes`` is its box's, scale box included); ``--tp N`` is checked against the model first
(:func:`~hybrid_model.hf.megatron_tp.check_tensor_split`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from hybrid_model.config import DSv4ModelConfig
from hybrid_model.hf.config_types import check_hf_config_types
from hybrid_model.hf.dist_format import TensorSpec, common_state_key
from hybrid_model.hf.io import read_config
from hybrid_model.hf.megatron_layout import TargetLayout, layer_segments, owned_boxes, segment_of
from hybrid_model.hf.megatron_tp import check_tensor_split, partition_axes
from hybrid_model.hf.quant.formats import QuantConfig
from hybrid_model.hf.released import Quantized, Stored, check_inventory, logical_shape
from hybrid_model.hf.runtime import ensure_single_stage_parallel_state
from hybrid_model.hf.source_box import SourceBox, box_read_bytes, source_box
from hybrid_model.hf.weights import official_placements
from hybrid_model.params import build_meta_model


@dataclass(frozen=True)
class Piece:
    """One write: source tensor ``src`` (stored name; ``scale`` pair when quantized), placed as the box ``[placed,
    placed + placed_shape)`` of checkpoint key ``key``, cast to ``dtype``; its part ``[offset, offset + shape)``
    (the whole placement, or one TP shard's slice of it) is written."""

    src: str
    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    read_bytes: int
    placed: tuple[int, ...]
    placed_shape: tuple[int, ...]

    def cut(self, t: torch.Tensor) -> torch.Tensor:
        """The written part of the source tensor ``t`` (shaped as its placement)."""
        t = t.reshape(self.placed_shape)
        if self.shape == self.placed_shape:
            return t
        return t[tuple(slice(o - p, o - p + n) for o, p, n in zip(self.offset, self.placed, self.shape))]

    def source_box(self, whole: tuple[int, ...]) -> SourceBox | None:
        """The box of the source tensor (logical shape ``whole``) this piece is read from, or ``None``: the whole
        tensor, then :meth:`cut` (the piece is all of it, or the source is stored in another shape than its
        placement)."""
        if tuple(whole) != self.placed_shape:
            return None
        return source_box(tuple(o - p for o, p in zip(self.offset, self.placed)), self.shape, whole)


@dataclass(frozen=True)
class RankJob:
    """Everything rank ``rank`` of the layout loads as its own: its file ``__{rank}_0.distcp``."""

    rank: int
    pieces: tuple[Piece, ...]
    objects: tuple[tuple[str, Any], ...]  # (unique key, data)

    @property
    def read_bytes(self) -> int:
        return sum(p.read_bytes for p in self.pieces)


@dataclass(frozen=True)
class MegatronPlan:
    src: Path
    model_config: DSv4ModelConfig
    layout: TargetLayout
    quant: QuantConfig | None
    stored: dict[str, Stored]
    pairs: dict[str, Quantized]
    jobs: tuple[RankJob, ...]
    tensors: dict[str, TensorSpec]
    objects: tuple[str, ...]
    fingerprint: str


def meta_checkpoint_entries(
    cfg: DSv4ModelConfig, tp: int = 1
) -> tuple[dict[str, tuple], list[ShardedObject], dict[str, int | None]]:
    """``key -> (global shape, dtype)`` of every checkpoint tensor, the objects, and ``key -> TP partition axis``
    (:func:`~hybrid_model.hf.megatron_tp.partition_axes`) of the single-stage model of ``cfg`` (built on the meta
    device); floating tensors are fp32 (what ``dsv4 convert`` has always saved). ``tp``: the model is checked to
    split over that many TP ranks (``ValueError`` naming the size that does not divide)."""
    ensure_single_stage_parallel_state()
    model = build_meta_model(cfg)
    tensors: dict[str, tuple] = {}
    objects: list[ShardedObject] = []
    for v in nested_values(model.sharded_state_dict()):
        if isinstance(v, ShardedTensor):
            if (
                v.prepend_axis_num
                or v.flattened_range is not None
                or tuple(v.local_shape) != tuple(v.global_shape)
            ):
                raise AssertionError(f"{v.key}: a single-stage model holds whole tensors, got {v}")
            dtype = torch.float32 if v.dtype.is_floating_point else v.dtype
            tensors[v.key] = (tuple(v.global_shape), dtype)
        elif isinstance(v, ShardedObject):
            objects.append(v)
        else:
            raise AssertionError(f"unexpected sharded state entry {type(v).__name__}")
    axes = partition_axes(model)
    check_tensor_split(model, cfg, axes, {k: shape for k, (shape, _) in tensors.items()}, tp)
    return tensors, objects, {k: axes.get(k) for k in tensors}


def _fingerprint(src: Path, stored: dict[str, Stored], layout: TargetLayout, extra: dict) -> str:
    files = sorted({s.file for s in stored.values()})
    text = json.dumps(
        {
            "src": str(src.resolve()),
            "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files],
            "layout": [layout.pp, layout.vpp, layout.ep, layout.tp],
            "extra": extra,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def plan_megatron(
    src: str | Path, layout: TargetLayout, *, mtp: bool | None = None, common: dict | None = None
) -> MegatronPlan:
    """Check the source (config types, then the tensor inventory: :func:`~hybrid_model.hf.released.
    check_inventory`), the layout against the model (:meth:`TargetLayout.stage_model_config`), and plan every
    rank's file. ``common``: the checkpoint's common state (megatron's ``common_state`` object)."""
    src = Path(src)
    check_hf_config_types(read_config(src), str(src / "config.json"))
    cfg, quant, stored, pairs, official = check_inventory(src, mtp=mtp)
    layer_segment = layer_segments(layout.stage_model_config(cfg))
    metas, objs, axes = meta_checkpoint_entries(cfg, layout.tp)
    placements = official_placements(cfg, {k: shape for k, (shape, _) in metas.items()})
    by_rank: dict[int, list[Piece]] = {r: [] for r in range(layout.world)}
    chunks: dict[str, list] = {k: [] for k in metas}
    for off, name in sorted(official.items()):
        pl = placements[off]
        shape, dtype = metas[pl.key]
        pair = pairs.get(name)
        whole = logical_shape(stored[name], pair.kind if pair else None)
        for box in owned_boxes(pl.key, pl.offset, pl.shape, shape, layout, layer_segment, axes[pl.key]):
            piece = Piece(name, box.key, box.offset, box.shape, dtype, 0, tuple(pl.offset), tuple(pl.shape))
            read = box_read_bytes(stored, name, pair, quant, piece.source_box(whole))
            by_rank[box.rank].append(dataclasses.replace(piece, read_bytes=read))
            chunks[box.key].append((box.offset, box.shape))
    for key, (shape, _) in metas.items():  # the boxes of a key tile it (placements never overlap)
        volume = sum(torch.Size(s).numel() for _, s in chunks[key])
        if volume != torch.Size(shape).numel():
            raise AssertionError(
                f"{key}: the planned boxes cover {volume} of {torch.Size(shape).numel()} elements"
            )
    objects: dict[int, list] = {r: [] for r in range(layout.world)}
    for o in objs:
        seg = segment_of(o.key, layer_segment, layout.segments)
        objects[layout.dense_rank(seg % layout.pp)].append((o.unique_key, o.data))
    objects[0].append((common_state_key(), dict(common or {})))
    jobs = tuple(
        RankJob(
            r, tuple(sorted(by_rank[r], key=lambda p: (str(stored[p.src].file), p.src))), tuple(objects[r])
        )
        for r in range(layout.world)
    )
    tensors = {k: TensorSpec(dtype, shape, tuple(chunks[k])) for k, (shape, dtype) in metas.items()}
    extra = {"mtp": mtp, "common": common or {}, "model": cfg.to_dict()}
    return MegatronPlan(
        src,
        cfg,
        layout,
        quant,
        stored,
        pairs,
        jobs,
        tensors,
        tuple(u for j in jobs for u, _ in j.objects),
        _fingerprint(src, stored, layout, extra),
    )
