"""Which rank of a target parallel layout owns which piece of a megatron dist checkpoint of :class:`DSv4Model`.

A layout is ``TP x PP x VPP x EP``. Its ranks are numbered as megatron-core numbers them (order ``tp-cp-ep-dp-pp``
with CP = 1 and DP = EP): a pipeline stage holds ``TP·EP`` ranks, rank ``p·TP·EP + r`` is its rank ``r``. The dense
grid puts TP fastest (rank ``r`` is TP rank ``r % TP``, data-parallel rank ``r // TP``); the expert grid
(``tp-ep-dp-pp`` with expert TP 1) puts EP fastest (rank ``r`` is expert rank ``r % EP``, expert-data-parallel rank
``r // EP``). The writer of a piece is its main replica (data-parallel rank 0 of its grid):
:meth:`TargetLayout.dense_rank` ``(p, t) = p·TP·EP + t``, :meth:`TargetLayout.expert_rank` ``(p, e) = p·TP·EP + e``.
The rules, from the model code (``dsv4_train.virtual_pipeline``, ``hash_moe.megatron.experts``,
:mod:`hybrid_model.hf.megatron_tp`):

* **stage**: the ``P·V`` ``|``-separated segments of the pattern (``pipeline_stages = P·V`` blocks split as evenly
  as possible, earlier segments get the extra block: :func:`hybrid_model.symbols.split_stages`); segment ``s`` is
  chunk ``s // P`` of pipeline rank ``s % P``. ``decoder.layers.{i}`` (global layer numbers) belong to the segment
  holding layer ``i``; the embedding to segment 0; ``decoder.final_norm``, ``decoder.hyper_head``,
  ``output_layer`` and ``mtp.*`` to the last segment (its MTP embedding copy is a replica of segment 0's);
* **expert**: routed expert banks ``[E, ...]`` are split along the expert axis: expert ``x`` belongs to expert
  rank ``x // (E / EP)`` (written by ``expert_rank(p, e)``; the banks are replicated over TP: expert TP 1);
* **tensor**: a TP-split tensor (its partition axis from the model ``dsv4 train --tp N`` builds:
  :func:`hybrid_model.hf.megatron_tp.partition_axes`) is cut at its TP shard edges, TP rank ``t``'s boxes written by
  ``dense_rank(p, t)``; every other tensor and object is written once, by ``dense_rank(p, 0)`` (the other ranks of
  the stage hold replicas and read it from there).

Each rank's file then holds exactly the pieces that rank loads, so ``dsv4 train --init-from`` at that layout
reads only its own stage's file(s) (plus the replicas named above), as a checkpoint saved by that layout would.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hybrid_model.config import DSv4ModelConfig
from hybrid_model.hf.megatron_tp import tp_cuts

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LAST = ("decoder.final_norm.", "decoder.hyper_head.", "output_layer.", "mtp.")
_EXPERT_BANKS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


@dataclass(frozen=True)
class TargetLayout:
    """A parallel layout of ``dsv4 train``: ``pp`` pipeline ranks with ``vpp`` chunks each, ``ep`` expert ranks,
    ``tp`` tensor ranks."""

    pp: int = 1
    vpp: int = 1
    ep: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "vpp", "ep", "tp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"--{name} must be a positive integer, got {v!r}")
        if self.vpp > 1 and self.pp < 2:
            raise ValueError(
                f"--vpp {self.vpp} needs pipeline stages to interleave: set --pp >= 2 or drop --vpp"
            )

    @property
    def world(self) -> int:
        return self.pp * self.ep * self.tp

    @property
    def segments(self) -> int:
        return self.pp * self.vpp

    def dense_rank(self, pp_rank: int, tp_rank: int = 0) -> int:
        """The global rank that writes TP rank ``tp_rank``'s shard of a dense (non-expert) tensor of pipeline rank
        ``pp_rank``: its data-parallel rank 0 (megatron's ``tp-cp-ep-dp-pp`` order, TP fastest)."""
        return pp_rank * self.ep * self.tp + tp_rank

    def expert_rank(self, pp_rank: int, ep_rank: int) -> int:
        """The global rank that writes expert rank ``ep_rank``'s experts of pipeline rank ``pp_rank``: its
        expert-data-parallel rank 0 (megatron's expert grid ``tp-ep-dp-pp`` with expert TP 1, EP fastest)."""
        return pp_rank * self.ep * self.tp + ep_rank

    def describe(self) -> str:
        parts = (
            [f"TP{self.tp}", f"PP{self.pp}"] + ([f"VPP{self.vpp}"] if self.vpp > 1 else []) + [f"EP{self.ep}"]
        )
        return " x ".join(parts) + f" ({self.world} rank(s))"

    def stage_model_config(self, cfg: DSv4ModelConfig) -> DSv4ModelConfig:
        """``cfg`` cut into this layout's ``P·V`` segments as ``dsv4 train --pp P --vpp V`` cuts it (``ValueError``
        naming the layout when the model cannot be: more segments than blocks, hash layers past segment 0, experts
        not divisible by EP)."""
        layout = (
            (f"--tp {self.tp} " if self.tp > 1 else "")
            + f"--pp {self.pp}"
            + (f" --vpp {self.vpp}" if self.vpp > 1 else "")
            + f" --ep {self.ep}"
        )
        experts = cfg.n_routed_experts
        if experts % self.ep:
            raise ValueError(
                f"{layout}: the model has {experts} routed experts per MoE layer, not divisible by --ep {self.ep}; "
                f"choose an --ep that divides {experts}"
            )
        if self.segments == 1:
            return cfg
        if cfg.hybrid_layer_pattern is not None:
            raise ValueError(
                f"{layout}: the model has an explicit layer pattern; only compress_ratios models (HF checkpoints) "
                "are cut into pipeline segments here"
            )
        if self.segments > cfg.num_layers:
            raise ValueError(
                f"{layout}: {self.segments} pipeline segments (PP x VPP) but the model has {cfg.num_layers} blocks; "
                f"choose PP x VPP <= {cfg.num_layers}"
            )
        try:
            return cfg.replace(pipeline_stages=self.segments)
        except ValueError as e:
            raise ValueError(f"{layout}: {e}") from e


def layer_segments(staged: DSv4ModelConfig) -> list[int]:
    """Segment index of every main layer (global layer number) of a staged model config."""
    out: list[int] = []
    for s, seg in enumerate(staged.parsed_pattern.segments):
        out += [s] * len(seg)
    return out


def segment_of(key: str, layer_segment: list[int], segments: int) -> int:
    """The segment whose chunk holds the main replica of checkpoint key ``key`` (see the module docstring)."""
    m = _LAYER.match(key)
    if m is not None:
        return layer_segment[int(m.group(1))]
    if key.startswith("embedding.") or key == "common_state":
        return 0
    if key.startswith(_LAST):
        return segments - 1
    raise ValueError(f"checkpoint key {key!r} has no pipeline stage rule (a new top-level module?)")


def is_expert_bank(key: str) -> bool:
    return key.endswith(_EXPERT_BANKS)


@dataclass(frozen=True)
class Box:
    """A box ``[offset, offset + shape)`` of checkpoint tensor ``key`` written into global rank ``rank``'s file."""

    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    rank: int


def owned_boxes(
    key: str,
    offset: tuple[int, ...],
    shape: tuple[int, ...],
    global_shape: tuple[int, ...],
    layout: TargetLayout,
    layer_segment: list[int],
    tp_axis: int | None = None,
) -> list[Box]:
    """The boxes a piece ``[offset, offset + shape)`` of ``key`` is written as, each with the rank that owns it.

    Stage rule, then the expert rule (a routed expert's piece lies inside one expert, so it is never cut), then the
    tensor rule: cut along ``tp_axis`` (the key's TP partition axis, ``None``: replicated) at the TP shard edges."""
    seg = segment_of(key, layer_segment, layout.segments)
    pp_rank = seg % layout.pp
    if is_expert_bank(key):
        if tp_axis is not None:
            raise ValueError(f"{key}: a routed expert bank marked TP-split along {tp_axis} (expert TP is 1)")
        per_rank = global_shape[0] // layout.ep
        first, last = offset[0] // per_rank, (offset[0] + shape[0] - 1) // per_rank
        if first != last:
            raise ValueError(f"{key}: piece at {offset} of shape {shape} spans expert ranks {first}..{last}")
        return [Box(key, offset, shape, layout.expert_rank(pp_rank, first))]
    return [
        Box(key, o, s, layout.dense_rank(pp_rank, t))
        for t, o, s in tp_cuts(offset, shape, global_shape, tp_axis, layout.tp)
    ]
