"""Cases and the gloo worker of the tensor-parallel parity tests (a module of its own: spawned workers import it).

Each case reuses the CP cases' tiny layer and packs (``_cp_cases``) with 4 heads in 4 output groups, so TP=2 and
TP=4 split whole groups. :func:`run_case` runs one training step (``loss = sum(y * w) + indexer loss``) at TP=1 (one
process) or as one TP rank: the rank's shard is the slice of the TP=1 parameters (``dsv4_attention.tp.shard_of``),
its input the sequence-parallel rows ``[r*L, (r+1)*L)``, and the replicated parameters' gradients are summed over
the TP group by megatron-core 0.19.2's own ``_allreduce_non_tensor_model_parallel_grads`` (what
``finalize_model_grads`` runs for parameters marked ``sequence_parallel``).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
import torch.distributed as dist
from _cp_cases import layout_of

from dsv4_attention import AttentionConfig, DSv4Attention, IndexerConfig, LayerKind, rope_config_for_kind
from dsv4_attention.attention_plan import SingleRankPlan
from dsv4_attention.indexer_loss import IndexerLossAutoScaler
from dsv4_attention.tp import HEAD_SPLIT, TensorParallelPlan, shard_of, tensor_parallel_layout

D = 32

CASES = {
    "window_mixed": dict(kind="WINDOW", pack="mixed"),
    "csa_dense_mixed": dict(kind="CSA", pack="mixed", dense=True),
    "csa_sparse_sparseloss_mixed": dict(kind="CSA", pack="mixed", sparse_loss=True),
    "csa_sparse_denseloss_mixed": dict(kind="CSA", pack="mixed", sparse_loss=False),
    # TP=4: 6 rows per rank, shorter than the halo (multi-hop)
    "csa_sparse_short": dict(kind="CSA", pack="short_shards", sparse_loss=True),
    # every index score 0 (the indexer's wq_b is zero): every selection is a tie, decided by lower_index
    "csa_sparse_ties": dict(kind="CSA", pack="mixed", sparse_loss=True, ties=True),
    "csa_sparse_no_valid_rows": dict(kind="CSA", pack="no_valid_rows", sparse_loss=True),
    "hca_long": dict(kind="HCA", pack="long"),
    "window_mixed_bf16": dict(kind="WINDOW", pack="mixed", dtype="bf16"),
    "csa_sparse_mixed_bf16": dict(kind="CSA", pack="mixed", sparse_loss=True, dtype="bf16", topk=8),
}

TP4_CASES = ("window_mixed", "csa_sparse_short", "csa_sparse_ties")  # TP=4 (kept few: CPU test time)


def full_model(case: dict, dtype: torch.dtype) -> DSv4Attention:
    """The seeded TP=1 layer of a case (4 heads, 4 output groups)."""
    kind = LayerKind[case["kind"]]
    torch.manual_seed(0)
    cfg = AttentionConfig(
        kind=kind,
        hidden_size=D,
        num_heads=4,
        head_dim=16,
        q_lora_rank=16,
        o_groups=4,
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
        if case.get("ties"):
            m.core_attention.indexer.linear_wq_b.weight.zero_()
    for name, p in m.named_parameters():  # sink / ape stay fp32 (keep-in-fp32 parameters)
        if p.dtype == torch.float32 and name.split(".")[-1] not in ("attn_sink", "ape"):
            p.data = p.data.to(dtype)
    return m.train()


def shard_model(full: DSv4Attention, rank: int, size: int) -> DSv4Attention:
    """TP rank ``rank``'s shard: built with ``tp_size=size``, every parameter the slice of the TP=1 one."""
    m = DSv4Attention(dataclasses.replace(full.cfg, tp_size=size))
    src = dict(full.named_parameters())
    for name, p in m.named_parameters():
        shard = shard_of(src[name].detach(), name, rank, size)
        if shard.shape != p.shape:
            raise AssertionError(f"{name}: shard {tuple(shard.shape)} vs TP parameter {tuple(p.shape)}")
        p.data = shard.clone()
    return m.train()


class TopkSpy:
    """Records the top-k ids the plans return (the ids the attention uses: all rows under TP)."""

    def __init__(self) -> None:
        self.ids: list[torch.Tensor] = []
        self._orig = {}

    def __enter__(self):
        for cls in (SingleRankPlan, TensorParallelPlan):
            orig = cls.select_topk
            self._orig[cls] = orig

            def spy(plan, *a, _orig=orig, **k):
                ids, scores = _orig(plan, *a, **k)
                self.ids.append(ids.detach().clone())
                return ids, scores

            cls.select_topk = spy
        return self

    def __exit__(self, *exc):
        for cls, orig in self._orig.items():
            cls.select_topk = orig


def _megatron_sum_replicated_grads(m: DSv4Attention, group) -> None:
    """megatron-core 0.19.2's TP all-reduce of the gradients of parameters marked ``sequence_parallel``."""
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

    m.ddp_config = SimpleNamespace(use_megatron_fsdp=False)  # what a megatron DDP chunk carries
    for p in m.parameters():  # DDP's fp32 main gradients (grad_reduce_in_fp32): the TP sum in fp32
        if p.grad is not None:
            p.main_grad = p.grad.float()
    config = SimpleNamespace(sequence_parallel=True, qk_layernorm=False)
    _allreduce_non_tensor_model_parallel_grads([m], config, group)


def run_case(name: str, dtype_name: str | None = None, group=None) -> dict:
    """One step of case ``name``; with ``group`` (size > 1) this rank's part of a TP run."""
    case = CASES[name]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name or case.get("dtype", "fp32")]
    full = full_model(case, dtype)
    glob = layout_of(case["pack"])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(glob.num_tokens, D, generator=g).to(dtype)
    w = torch.randn(glob.num_tokens, D, generator=g).to(dtype)
    m, layout = full, glob
    if group is not None:
        layout = tensor_parallel_layout(glob, group)
        m = shard_model(full, layout.rank, layout.size)
        x, w = (t[layout.local_rows] for t in (x, w))
    x = x.clone().requires_grad_(True)
    IndexerLossAutoScaler.reset()
    with TopkSpy() as spy:
        y, loss = m(x, layout, dense=case.get("dense", False), indexer_loss_coeff=1.0)
    (y.float() * w.float()).sum().backward()
    if group is not None:
        _megatron_sum_replicated_grads(m, group)
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
        marks={
            n: (getattr(p, "partition_dim", None), getattr(p, "sequence_parallel", False))
            for n, p in m.named_parameters()
        },
    )


def world_worker(rank: int, world: int, names: tuple[str, ...] = tuple(CASES)) -> dict:
    """Cases ``names`` at TP=2 (groups {0,1}, {2,3}) and TP=4 on one 4-rank gloo world; rank-local results."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    full = dist.new_group(list(range(world)))
    out = {}
    for name in names:
        out[(name, 2)] = run_case(name, group=pairs[rank // 2])
        if name in TP4_CASES:
            out[(name, 4)] = run_case(name, group=full)
    return out


def gathered_grad(name: str, per_rank: list[torch.Tensor]) -> torch.Tensor:
    """The TP=1 gradient from the ranks' gradients: head-split ones concatenated along their partition dim, the
    replicated ones (already summed over TP by megatron) from rank 0."""
    dim = HEAD_SPLIT.get(name)
    return per_rank[0] if dim is None else torch.cat(per_rank, dim)
