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
from _attention_testconfig import tiny_config
from _cp_cases import PACKS, layout_of
from _tp_cases import CASES, D, TopkSpy, _megatron_sum_replicated_grads, full_model, shard_model
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import build_module

from dsv4_attention import DSv4Attention, LayerKind
from dsv4_attention.indexer_loss import IndexerLossAutoScaler, get_indexer_loss_tracker
from dsv4_attention.layout import thd_layout
from dsv4_attention.megatron import get_dsv4_attention_spec
from dsv4_attention.tp import shard_of, tensor_context_parallel_layout
from dsv4_testkit import megatron_cpu_context

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


def world_worker(rank: int, world: int, names: tuple[str, ...] = tuple(CASES), adapter: bool = True) -> dict:
    """Cases ``names`` at TP=2 x CP=2 on one 4-rank gloo world, then (``adapter``) the megatron adapter at TP=2 x
    CP=2 in megatron's parallel state; rank-local results."""
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_cp = dist.new_group(list(range(world)))
    tp_group, cp_group = tp_groups[rank // TP], cp_groups[rank % TP]
    out = {name: run_tpcp_case(name, tp_group, cp_group, tp_cp) for name in names}
    out["swapped"] = swapped_groups(tp_group, cp_group, tp_cp)
    if adapter:
        with megatron_cpu_context(tp=TP, cp=CP):
            out["adapter"] = {kind: adapter_step(ratio) for kind, ratio in ADAPTER_KINDS.items()}
    return out


ADAPTER_KINDS = {"csa": 4, "window": 0}


def adapter_reference_layer(kind_ratio: int, tp_size: int = 1):
    """The seeded one-process core layer of the adapter test (the tiny megatron config's TP=1 attention; the
    adapter's parameters and numerics are the core's)."""
    cfg = tiny_config(dsa_indexer_loss_coeff=1.0)
    torch.manual_seed(0)
    m = DSv4Attention(cfg.attention_config(LayerKind.from_ratio(kind_ratio), tp_size))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    return m.train(), cfg.hidden_size


def adapter_batch(hidden: int):
    """The global THD pack (``_cp_cases.PACKS['mixed']``: 48 rows, documents crossing every rank edge at 4 ranks),
    its ``PackedSeqParams``, input and cotangent ``[T, 1, d]``."""
    lengths, padded, total = PACKS["mixed"]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cup = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cup,
        cu_seqlens_kv_padded=cup,
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(total, 1, hidden, generator=g)
    w = torch.randn(total, 1, hidden, generator=g)
    return psp, x, w


def adapter_step(kind_ratio: int) -> dict:
    """One sparse-phase step of the megatron adapter at TP=2 x CP=2 inside megatron's parallel state (groups from
    ``ProcessGroupCollection.use_mpu_process_groups()``): the shards of the reference layer, this rank's rows
    ``[r*L, (r+1)*L)`` of the global pack, the global ``PackedSeqParams``."""
    pg = ProcessGroupCollection.use_mpu_process_groups()
    full, hidden = adapter_reference_layer(kind_ratio)
    cfg = tiny_config(
        tensor_model_parallel_size=TP,
        sequence_parallel=True,
        context_parallel_size=CP,
        dsa_indexer_loss_coeff=1.0,
    )
    m = build_module(get_dsv4_attention_spec(kind_ratio), config=cfg, layer_number=1, pg_collection=pg)
    src = dict(full.named_parameters())
    t, c = pg.tp.rank(), pg.cp.rank()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(shard_of(src[name].detach(), name, t, TP))
    m.train().set_dense_attention(False)
    psp, x, w = adapter_batch(hidden)
    big_l = x.shape[0] // (TP * CP)
    r = c * TP + t
    x, w = (v[r * big_l : (r + 1) * big_l] for v in (x, w))
    x = x.clone().requires_grad_(True)
    IndexerLossAutoScaler.reset()
    tracker = get_indexer_loss_tracker()
    tracker.reset()
    y, _ = m(x, packed_seq_params=psp)
    (y * w).sum().backward()
    out = dict(
        ranks=(dist.get_rank(), c, t),
        y=y.detach()[:, 0],
        xg=x.grad[:, 0],
        grads={n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None},
        logged=None if tracker.values is None else tracker.values[m.tracker_slot].clone(),
        sums_over_tp_cp=tracker.reduce_group is pg.tp_cp,
    )
    tracker.reset()
    return out


def adapter_reference(kind_ratio: int) -> dict:
    """The reference layer on the whole pack, one process (no megatron state)."""
    full, hidden = adapter_reference_layer(kind_ratio)
    psp, x, w = adapter_batch(hidden)
    x = x[:, 0].clone().requires_grad_(True)
    IndexerLossAutoScaler.reset()
    y, loss = full(x, thd_layout(psp, x.shape[0]), dense=False, indexer_loss_coeff=1.0)
    (y * w[:, 0]).sum().backward()
    return dict(
        y=y.detach(),
        xg=x.grad,
        grads={n: p.grad.float() for n, p in full.named_parameters() if p.grad is not None},
        loss=None if loss is None else loss.detach(),
    )
