"""The tensor-parallel split of a megatron dist checkpoint of :class:`~hybrid_model.model.DSv4Model`, read off the
model that ``dsv4 train --tp N`` builds.

Under ``--tp N`` every TP-split parameter is checkpointed as its TP rank's contiguous slice of the TP=1 tensor along
its ``partition_dim`` (the keys and global shapes are the TP=1 model's; rank ``t`` of ``N`` holds slice ``t``); every
other tensor is one replica over TP (hybrid-model ``tests/test_tp_checkpoint_sharding.py``). Which parameters are
split, and along which axis, is what the model's own code marks with megatron's attributes
``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride``:

* megatron's layers (vocab-parallel embedding and output layer: axis 0; column-parallel linears: 0; row-parallel:
  1) set them at every TP size, TP = 1 included;
* DSv4 attention marks its head split (:func:`dsv4_attention.tp.mark_tensor_parallel`: ``linear_q_up_proj``, the
  sinks, ``linear_o_group_proj`` along 0, ``linear_proj`` along 1; the token-local half replicated) when it is
  built for ``tp_size > 1``; :func:`partition_axes` applies that same marking to the TP = 1 meta model;
* the routed expert banks (hash-moe, expert TP 1) carry no TP mark: replicated over TP, split over EP.

So the converter and the trainer cannot drift: a new split parameter is split here as soon as the model marks it
(the test builds the real TP = 2 model and compares every checkpoint entry). :func:`check_tensor_split` refuses a
``--tp`` the model cannot be built with, in one line naming the size and the ``--tp`` values that fit.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from dsv4_attention.attention import DSv4Attention
from dsv4_attention.tp import mark_tensor_parallel
from hybrid_model.config import DSv4ModelConfig
from hybrid_model.tensor_parallel import check_tensor_parallel_pattern

#: the most ``--tp`` values listed as fitting in a refusal
_LISTED = 64


def partition_axes(model: torch.nn.Module) -> dict[str, int | None]:
    """``checkpoint key -> TP partition axis`` (``None``: replicated over TP) of every parameter of the TP = 1
    ``model`` (a single-stage meta model), as ``dsv4 train --tp N`` splits it (module docstring). Marks the model's
    DSv4 attention layers as a ``tp_size > 1`` build does; parameters are matched to their ShardedTensor by identity
    (as megatron's optimizer matches them)."""
    for m in model.modules():
        if isinstance(m, DSv4Attention):
            mark_tensor_parallel(m)
    keys = {
        id(v.data): v.key for v in nested_values(model.sharded_state_dict()) if isinstance(v, ShardedTensor)
    }
    axes: dict[str, int | None] = {}
    for name, p in model.named_parameters():
        key = keys.get(id(p))
        if key is None:
            raise AssertionError(f"parameter {name} has no ShardedTensor in the model's sharded state dict")
        if not getattr(p, "tensor_model_parallel", False):
            axes[key] = None
            continue
        stride = int(getattr(p, "partition_stride", 1))
        if stride != 1:
            raise ValueError(
                f"{key}: partition_stride {stride}; the converter splits TP shards contiguously (stride 1) only"
            )
        axes[key] = int(p.partition_dim)
    return axes


def _problem(model: torch.nn.Module, cfg: DSv4ModelConfig, axes: dict, shapes: dict, tp: int) -> str | None:
    """Why the model cannot run at ``tp`` (the first reason), or ``None``."""
    try:
        check_tensor_parallel_pattern(cfg.parsed_pattern.all_symbols, tp)
        for m in model.modules():
            if isinstance(m, DSv4Attention):
                dataclasses.replace(m.cfg, tp_size=tp)  # the layer's own check (output groups per TP rank)
    except ValueError as e:
        return str(e).removeprefix(f"--tp {tp}: ")
    for key, axis in sorted(axes.items()):
        if axis is not None and shapes[key][axis] % tp:
            return (
                f"{key} has {shapes[key][axis]} entries along its tensor-parallel axis {axis} "
                f"(shape {tuple(shapes[key])}), not divisible by {tp}"
            )
    return None


def check_tensor_split(
    model: torch.nn.Module, cfg: DSv4ModelConfig, axes: dict[str, int | None], shapes: dict, tp: int
) -> None:
    """``ValueError`` (one line: the size that ``--tp tp`` does not divide, and the ``--tp`` values that fit) when
    the model of ``cfg`` (``model``: its meta model, ``axes`` from :func:`partition_axes`, ``shapes``: key -> global
    shape) cannot be split over ``tp`` ranks."""
    problem = _problem(model, cfg, axes, shapes, tp)
    if problem is None:
        return
    split = [shapes[k][a] for k, a in axes.items() if a is not None]
    g = math.gcd(*split) if split else 1
    fits = [
        t
        for t in range(1, min(g, _LISTED) + 1)
        if g % t == 0 and _problem(model, cfg, axes, shapes, t) is None
    ]
    raise ValueError(
        f"--tp {tp}: {problem}; --tp {', '.join(map(str, fits))} fit{'s' if len(fits) == 1 else ''} this model"
    )


def tp_cuts(
    offset: tuple[int, ...], shape: tuple[int, ...], global_shape: tuple[int, ...], axis: int | None, tp: int
) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """``[(tp_rank, offset, shape)]``: the piece ``[offset, offset + shape)`` of a tensor of ``global_shape`` cut at
    the TP shard edges along ``axis`` (rank ``t`` holds ``[t·n/tp, (t+1)·n/tp)``); a replicated tensor (``axis``
    ``None``) or ``tp == 1``: the whole piece, TP rank 0 (the replica that writes it)."""
    if axis is None or tp == 1:
        return [(0, offset, shape)]
    per = global_shape[axis] // tp
    lo, hi = offset[axis], offset[axis] + shape[axis]
    out = []
    for t in range(lo // per, (hi - 1) // per + 1):
        a, b = max(lo, t * per), min(hi, (t + 1) * per)
        out.append(
            (
                t,
                tuple(a if i == axis else o for i, o in enumerate(offset)),
                tuple(b - a if i == axis else s for i, s in enumerate(shape)),
            )
        )
    return out
