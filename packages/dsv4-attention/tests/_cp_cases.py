"""Cases and the gloo worker of the CP parity tests (a module of its own: spawned workers import it by name).

Every case builds the same tiny core ``DSv4Attention`` (seeded), a global packed batch and output cotangent, and runs
one training step: ``loss = sum(y * w) + indexer loss`` (the indexer loss reaches the graph through the
auto-scaler, scale 1). :func:`run_case` does it at CP=1 (one process) or as one rank of a CP group.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from dsv4_attention import AttentionConfig, DSv4Attention, IndexerConfig, LayerKind, rope_config_for_kind
from dsv4_attention.cp import context_parallel_layout
from dsv4_attention.indexer_loss import IndexerLossAutoScaler, get_indexer_loss_tracker
from dsv4_attention.layout import thd_layout

D = 32

# (lengths, padded lengths or None, total rows T): documents crossing rank boundaries at CP=2 and CP=4, an empty
# document, documents shorter than the window (8) and than a ratio-4 group, per-document padding, a static tail
PACKS = {
    "mixed": ([13, 0, 3, 20], [13, 0, 5, 22], 48),
    # CP=4: L = 6 rows per rank, shorter than the CSA halo (7) and the window halo (7): multi-hop halos
    "short_shards": ([17, 7], None, 24),
    # HCA: ratio-128 groups straddle ranks (CP=2: group [128, 256) crosses row 192), CP=4: L = 96 < halo 127
    "long": ([300, 3, 0, 60], [300, 3, 0, 64], 384),
    "no_valid_rows": ([3, 3, 3, 3, 20], None, 48),
}

CASES = {
    "window_mixed": dict(kind="WINDOW", pack="mixed"),
    "window_short": dict(kind="WINDOW", pack="short_shards"),
    "csa_dense_mixed": dict(kind="CSA", pack="mixed", dense=True),
    "csa_sparse_sparseloss_mixed": dict(kind="CSA", pack="mixed", sparse_loss=True),
    "csa_sparse_denseloss_mixed": dict(kind="CSA", pack="mixed", sparse_loss=False),
    "csa_sparse_short": dict(kind="CSA", pack="short_shards", sparse_loss=True),
    "hca_long": dict(kind="HCA", pack="long"),
    # CP=4: rank 0 holds only documents shorter than a ratio-4 group, rank 3 only the static tail: no valid
    # indexer-loss rows there, yet their indexer parameters must get (zero) gradients (upstream #5643)
    "csa_sparse_no_valid_rows": dict(kind="CSA", pack="no_valid_rows", sparse_loss=True),
    # bf16: topk >= every document's entry count, so the selected SET cannot depend on bf16 rounding of the scores
    # (projections of h + L rows vs T rows may round differently); selection ties are tested in fp32 above
    "window_mixed_bf16": dict(kind="WINDOW", pack="mixed", dtype="bf16"),
    "csa_sparse_mixed_bf16": dict(kind="CSA", pack="mixed", sparse_loss=True, dtype="bf16", topk=8),
    "hca_long_bf16": dict(kind="HCA", pack="long", dtype="bf16"),
}


def layout_of(pack: str):
    return pack_layout(*PACKS[pack])


def pack_layout(lengths, padded, total: int):
    """The global THD layout of documents ``lengths`` (``padded``: their padded lengths or ``None``) in ``total``
    rows."""

    def cu(v):
        return torch.tensor([0, *torch.tensor(v, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)

    psp = SimpleNamespace(
        cu_seqlens_q=cu(lengths),
        cu_seqlens_kv=cu(lengths),
        cu_seqlens_q_padded=None if padded is None else cu(padded),
        local_cp_size=None,
        cp_group=None,
    )
    return thd_layout(psp, total)


def build_model(case: dict, dtype: torch.dtype) -> DSv4Attention:
    kind = LayerKind[case["kind"]]
    torch.manual_seed(0)
    cfg = AttentionConfig(
        kind=kind,
        hidden_size=D,
        num_heads=2,
        head_dim=16,
        q_lora_rank=16,
        o_groups=2,
        o_lora_rank=8,
        window=8,
        rope=rope_config_for_kind(kind, 4),
        indexer=IndexerConfig(hidden_size=D, q_lora_rank=16, n_heads=2, head_dim=8, topk=case.get("topk", 3)),
        use_sparse_loss=case.get("sparse_loss", False),
        backend="reference",
    )
    m = DSv4Attention(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    for name, p in m.named_parameters():  # sink / ape stay fp32 (keep-in-fp32 parameters)
        if p.dtype == torch.float32 and name.split(".")[-1] not in ("attn_sink", "ape"):
            p.data = p.data.to(dtype)
    return m.train()


def run_case(name: str, dtype_name: str | None = None, group=None) -> dict:
    """One step of case ``name``; with ``group`` this rank's slice of a CP run. Returns y, x grad, loss, grads."""
    case = CASES[name]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name or case.get("dtype", "fp32")]
    m = build_model(case, dtype)
    glob = layout_of(case["pack"])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(glob.num_tokens, D, generator=g).to(dtype)
    w = torch.randn(glob.num_tokens, D, generator=g).to(dtype)
    layout = glob
    if group is not None:
        layout = context_parallel_layout(glob, group)
        x, w = (t[layout.local_start : layout.local_stop] for t in (x, w))
    x = x.clone().requires_grad_(True)
    IndexerLossAutoScaler.reset()
    y, loss = m(x, layout, dense=case.get("dense", False), indexer_loss_coeff=1.0)
    (y.float() * w.float()).sum().backward()
    grads = {n: (p.grad.float() if p.grad is not None else None) for n, p in m.named_parameters()}
    return dict(
        y=y.detach().float(),
        xg=x.grad.float(),
        loss=None if loss is None else loss.detach().float(),
        grads=grads,
    )


def world_worker(rank: int, world: int, names: tuple[str, ...] = tuple(CASES), adapter: bool = True) -> dict:
    """Cases ``names`` at CP=2 (groups {0,1}, {2,3}) and CP=4 on one 4-rank gloo world, then (``adapter``) the
    megatron adapter at CP=2 x DP=2; rank-local results."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    full = dist.new_group(list(range(world)))
    out = {}
    for name in names:
        out[(name, 2)] = run_case(name, group=pairs[rank // 2])
        out[(name, 4)] = run_case(name, group=full)
    out["halo"] = {d: halo_step(d, full) for d in HALO_SIZES}
    if adapter:
        from dsv4_testkit import megatron_cpu_context

        with megatron_cpu_context(cp=2):
            out["adapter"] = adapter_step(2, rank)
    return out


HALO_SIZES = (3, 7, 20)  # global rows T = 24 at CP=4: L = 6 > 3, L < 7 (two hops), L < 20 (four hops)


def halo_step(halo_request: int, group) -> dict:
    """``exchange_halo`` of global rows ``x[g] = g`` (T = 24) with cotangent ``c[g] = g + 1`` per extended row."""
    from dsv4_attention.cp import exchange_halo

    glob = layout_of("short_shards")
    cpl = context_parallel_layout(glob, group)
    halo = min(halo_request, cpl.local_start)
    rows = torch.arange(glob.num_tokens, dtype=torch.float32)[:, None].repeat(1, 2)
    x = rows[cpl.local_start : cpl.local_stop].clone().requires_grad_(True)
    ext = exchange_halo(x, halo_request, halo, cpl)
    (ext * (ext.detach() + 1)).sum().backward()
    return dict(ext=ext.detach(), start=cpl.local_start - halo, stop=cpl.local_stop, xg=x.grad)


ADAPTER_PACK = "mixed"


def adapter_step(cp_group_size: int, rank: int = 0) -> dict:
    """One CSA sparse-phase step of the megatron adapter inside an initialised megatron state (CP from
    ``pg_collection.cp``); ``hidden_states`` = this CP rank's rows, ``packed_seq_params`` = the global pack."""
    from _attention_testconfig import tiny_config
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from dsv4_attention.megatron import get_dsv4_attention_spec

    pg = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(0)
    cfg = tiny_config(context_parallel_size=cp_group_size, dsa_indexer_loss_coeff=1.0)
    m = build_module(get_dsv4_attention_spec(4), config=cfg, layer_number=1, pg_collection=pg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    m.train().set_dense_attention(False)
    lengths, padded, total = PACKS[ADAPTER_PACK]
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
    x = torch.randn(total, 1, cfg.hidden_size, generator=g)
    w = torch.randn(total, 1, cfg.hidden_size, generator=g)
    cp_rank = pg.cp.rank() if cp_group_size > 1 else 0
    big_l = total // cp_group_size
    x, w = (t[cp_rank * big_l : (cp_rank + 1) * big_l] for t in (x, w))
    x = x.clone().requires_grad_(True)
    IndexerLossAutoScaler.reset()
    tracker = get_indexer_loss_tracker()
    tracker.reset()
    y, _ = m(x, packed_seq_params=psp)
    (y * w).sum().backward()
    grads = {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}
    logged = tracker.values[m.tracker_slot].clone()
    sums_over_cp = tracker.reduce_group is (pg.cp if cp_group_size > 1 else None)
    tracker.reset()
    return dict(y=y.detach(), xg=x.grad, grads=grads, logged=logged, sums_over_cp=sums_over_cp)
