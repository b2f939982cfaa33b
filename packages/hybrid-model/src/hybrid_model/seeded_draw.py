"""The draws of layout-independent initialisation (:mod:`hybrid_model.seeded_init`): a generator per parameter
seeded from ``(seed, global name[, global expert])``, tensor-parallel shards as slices of the whole drawn tensor.
No megatron import: the model walk that picks each parameter's distribution lives in ``seeded_init``."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
import torch.distributed as dist


def parameter_seed(seed: int, name: str, index: int | None = None) -> int:
    """The generator seed of parameter ``name`` (its one-process name; ``index``: a routed expert's global index):
    the first 63 bits of ``blake2b("{seed}/{name}[/{index}]")`` (stable across processes and Python versions)."""
    key = f"{int(seed)}/{name}" + ("" if index is None else f"/{int(index)}")
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


def group_rank_size(group) -> tuple[int, int]:
    """``(rank, size)`` of ``group``; ``(0, 1)`` without a group or a default process group."""
    if group is None or not dist.is_initialized():
        return 0, 1
    return group.rank(), group.size()


def normal_draw(shape: Iterable[int], std: float, seed: int, device: torch.device) -> torch.Tensor:
    """``normal(0, std)`` fp32 values of ``shape`` on ``device`` from a fresh generator seeded ``seed``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.empty(tuple(shape), dtype=torch.float32, device=device).normal_(0.0, std, generator=gen)


def tp_shard_draw(p: torch.Tensor, std: float, key: int, tp_group) -> torch.Tensor:
    """``normal(0, std)`` values for ``p`` (fp32) from the generator seeded ``key``: for a tensor-parallel shard
    (megatron's ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride``) this rank's part of the whole
    TP=1 tensor drawn at once, taken by megatron's rule (``_initialize_affine_weight_cpu``: the TP=1 tensor cut along
    ``partition_dim`` into chunks of ``shard / stride`` rows, rank ``r`` holding chunks ``r, r + TP, ...``; stride 2
    is the fused SwiGLU ``[gate; up]`` projection), so the shards of every TP size are parts of the same tensor."""
    if not getattr(p, "tensor_model_parallel", False):
        return normal_draw(p.shape, std, key, p.device)
    rank, size = group_rank_size(tp_group)
    if size == 1:
        return normal_draw(p.shape, std, key, p.device)
    dim, stride = int(p.partition_dim), int(getattr(p, "partition_stride", 1))
    if p.shape[dim] % stride:
        raise ValueError(
            f"a TP shard of {p.shape[dim]} rows along dim {dim} does not split into stride {stride}"
        )
    shape = list(p.shape)
    shape[dim] *= size
    chunks = normal_draw(shape, std, key, p.device).split(p.shape[dim] // stride, dim=dim)
    return torch.cat(chunks[rank::size], dim=dim)


__all__ = ["group_rank_size", "normal_draw", "parameter_seed", "tp_shard_draw"]
