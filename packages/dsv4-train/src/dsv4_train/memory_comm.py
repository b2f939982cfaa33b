"""Per-rank tensor-parallel communication of one training step (``dsv4 memory --comm``), from the analytic model of
:mod:`hybrid_model.tp_comm` (collectives, full-tensor shapes, ring bytes per rank).

For the rank of pipeline stage ``stage``, with ``M`` micro-batches per step (``global_batch / (micro_batch · DP)``)
of ``T = micro_batch · seq_len / CP`` rows per TP group::

    per step = M · Σ_{its layers, embedding, head and MTP depths} (forward + backward bytes of one micro-batch)
             + M · forward bytes of the recomputed layers (``--recompute-granularity full``: their forward,
               collectives included, runs again in the backward)
             + 2·(TP-1)/TP · 4 · (replicated parameters of the stage)   the fp32 gradient all-reduce over TP

Bytes are what one rank sends (= receives) under the ring algorithm (NCCL's bus bytes); the CSA layers are
counted in their sparse phase (after the indexer's dense warm-up). Not counted (module doc of ``tp_comm``): the
CP, PP, EP and DP collectives, scalar reductions outside the layers.
"""

from __future__ import annotations

from dsv4_train.config import TrainConfig
from dsv4_train.model_config import model_config_for
from hybrid_model.config import DSv4ModelConfig
from hybrid_model.params import hyper_head_params
from hybrid_model.tp_comm import (
    Collective,
    embedding_collectives,
    head_collectives,
    layer_collectives,
    replicated_params,
    total_bytes,
)


def _replicated_outside_layers(cfg: DSv4ModelConfig, last: bool) -> int:
    """The final norm and HyperHead, each MTP depth's projections, norms and HyperHead (last stage only)."""
    if not last:
        return 0
    d, depths = cfg.hidden_size, cfg.parsed_pattern.mtp_num_depths
    return d + hyper_head_params(cfg) + depths * (2 * d * d + 3 * d + hyper_head_params(cfg))


def tp_comm_per_step(tc: TrainConfig, *, dp: int, stage: int = 0, tp: int | None = None) -> dict[str, float]:
    """Bytes one TP rank of pipeline stage ``stage`` sends (= receives) over its TP group in one step of ``tc`` on
    ``dp`` data-parallel replicas, by part (module doc); ``{}`` at TP 1. ``tp``: the TP size modelled (default
    ``tc.parallel.tp``; :func:`dsv4_train.memory_model.estimate_memory`)."""
    par = tc.parallel
    tp = par.tp if tp is None else tp
    if tp == 1:
        return {}
    cfg = model_config_for(tc)
    bf16 = True if tc.precision.bf16 is None else tc.precision.bf16
    b = 2 if bf16 else 4
    mbs = 1 if tc.data.packed else tc.data.micro_batch_size
    tokens = tc.data.seq_len * mbs // par.cp
    microbatches = max(1, tc.data.global_batch_size // (mbs * dp))
    stages = par.pp * par.vpp
    chunks = {stage + v * par.pp for v in range(par.vpp)}
    last = (stages - 1) in chunks
    full = tc.memory.recompute_granularity == "full"
    fused = tc.precision.fused_linear_ce

    def of(symbol, li) -> list[Collective]:
        return layer_collectives(cfg, symbol, tokens, tp, b=b, learned=li.router == "learned", sequences=mbs)

    parts = {"attention (W, C, H)": 0.0, "MoE shared expert + routers (E), MLP (-, *)": 0.0}
    replicated = _replicated_outside_layers(cfg, last)
    recompute = 0.0
    for li in cfg.layers():
        if (li.mtp_depth and not last) or (not li.mtp_depth and li.stage not in chunks):
            continue
        coll = of(li.symbol, li)
        key = "attention (W, C, H)" if li.symbol in "WCH" else "MoE shared expert + routers (E), MLP (-, *)"
        parts[key] += total_bytes(coll, tp)
        if full and not li.mtp_depth:
            recompute += total_bytes(coll, tp, "forward")
        replicated += replicated_params(cfg, li.symbol, li.router == "hash")
    embed_head = 0.0
    if stage == 0:
        embed_head += total_bytes(embedding_collectives(cfg, tokens, tp, b=b), tp)
    if last:
        heads = 1 + cfg.parsed_pattern.mtp_num_depths
        embed_head += heads * total_bytes(head_collectives(cfg, tokens, tp, b=b, fused=fused), tp)
        embed_head += (heads - 1) * total_bytes(embedding_collectives(cfg, tokens, tp, b=b), tp)
    out = {k: v * microbatches for k, v in parts.items()}
    out["embedding + heads"] = embed_head * microbatches
    if full:
        out["recomputed forwards"] = recompute * microbatches
    out["replicated-gradient all-reduce (fp32)"] = 2 * (tp - 1) / tp * 4 * replicated
    return out


__all__ = ["tp_comm_per_step"]
