"""gloo worker of ``test_seeded_init.py`` (a module of its own: the spawned ranks import torch and
``hybrid_model.seeded_draw`` only, not megatron)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybrid_model.seeded_draw import tp_shard_draw


def tp_shards(rank: int, world: int) -> list[torch.Tensor]:
    """This rank's shards of a ``[6, 4]`` weight split over the world on dim 0 and on dim 1 (key 99, std 0.02)."""
    out = []
    for dim in (0, 1):
        shape = [6, 4]
        shape[dim] //= world
        p = torch.nn.Parameter(torch.empty(shape))
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
        out.append(tp_shard_draw(p, 0.02, 99, dist.group.WORLD))
    return out
