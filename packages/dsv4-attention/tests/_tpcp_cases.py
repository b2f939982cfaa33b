"""The gloo worker of the TP x CP parity tests (a module of its own: spawned workers import it).

The cases, layers and shards are the TP tests' (``_tp_cases``: 4 heads in 4 output groups, the CP tests' packs). On
a 4-rank world, TP=2 x CP=2 with megatron's order (TP fastest): global rank ``r`` is CP rank ``c = r // 2`` and TP
rank ``t = r % 2``; TP groups {0, 1}, {2, 3}, CP groups {0, 2}, {1, 3}, the TP x CP group every rank (its rank
``c*2 + t = r``). Rank ``(c, t)`` holds the rows ``[r*L, (r+1)*L)``, ``L = T / 4``, and the TP shard ``t``; its
replicated parameters' gradients are summed over its TP group by megatron-core 0.19.2's own helper (as in the TP
tests); the sum over CP is the data-parallel reduction megatron's DDP does and is left to the test.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from _cp_cases import layout_of
from _tp_cases import CASES, D, TopkSpy, _megatron_sum_replicated_grads, full_model, shard_model

from dsv4_attention.indexer_loss import IndexerLossAutoScaler
from dsv4_attention.tp import tensor_context_parallel_layout

TP, CP = 2, 2


def run_tpcp_case(name: str, tp_group, cp_group, tp_cp_group) -> dict:
    """One step of case ``name`` as this rank's part of a TP x CP run (``_tp_cases.run_case`` at TP=1 is the
    reference)."""
    case = CASES[name]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[case.get("dtype", "fp32")]
    full = full_model(case, dtype)
    glob = layout_of(case["pack"])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(glob.num_tokens, D, generator=g).to(dtype)
    w = torch.randn(glob.num_tokens, D, generator=g).to(dtype)
    layout = tensor_context_parallel_layout(glob, tp_group, cp_group, tp_cp_group)
    m = shard_model(full, layout.rank, layout.size)
    x, w = (t[layout.local_rows] for t in (x, w))
    x = x.clone().requires_grad_(True)
    IndexerLossAutoScaler.reset()
    with TopkSpy() as spy:
        y, loss = m(x, layout, dense=case.get("dense", False), indexer_loss_coeff=1.0)
    (y.float() * w.float()).sum().backward()
    _megatron_sum_replicated_grads(m, tp_group)
    grads = {
        n: (getattr(p, "main_grad", p.grad).float() if p.grad is not None else None)
        for n, p in m.named_parameters()
    }
    return dict(
        y=y.detach().float(),
        xg=x.grad.float(),
        loss=None if loss is None else loss.detach().float(),
        grads=grads,
        topk=spy.ids,
        chunk=(layout.context.local_start, layout.context.local_stop),
    )


def swapped_groups(tp_group, cp_group, tp_cp_group) -> str:
    """The ValueError of TP and CP groups passed the wrong way round (the sequence order would be CP fastest:
    ranks 1 and 2 then hold each other's rows), or ``""`` where the swap happens to agree (ranks 0 and 3)."""
    try:
        tensor_context_parallel_layout(layout_of("mixed"), cp_group, tp_group, tp_cp_group)
    except ValueError as err:
        return str(err)
    return ""


def world_worker(rank: int, world: int, names: tuple[str, ...] = tuple(CASES)) -> dict:
    """Cases ``names`` at TP=2 x CP=2 on one 4-rank gloo world; rank-local results."""
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_cp = dist.new_group(list(range(world)))
    tp_group, cp_group = tp_groups[rank // TP], cp_groups[rank % TP]
    out = {name: run_tpcp_case(name, tp_group, cp_group, tp_cp) for name in names}
    out["swapped"] = swapped_groups(tp_group, cp_group, tp_cp)
    return out
