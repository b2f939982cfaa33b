"""Static memory of one rank of ``dsv4 train``: parameters, gradient buffers and the distributed optimizer's state
(issue 33, ``dsv4 memory``; the activations are :mod:`hybrid_model.activation_memory`).

What the trainer builds (:mod:`dsv4_train.setup`): megatron's DDP with ``grad_reduce_in_fp32=True`` and the
distributed optimizer (torch AdamW). Per parameter of this rank's pipeline stage (routed experts divided by ``EP``)::

    parameter         2 B (bf16) or 4 B (fp32 runs and the keep-in-FP32 tensors: mHC, HyperHeads, attention
                      sinks, compressor ape)
    gradient buffer   4 B (fp32 main_grad, full size on every rank: reduce-scattered, not sharded)
    optimizer         (4 B fp32 main param, bf16 params only + 8 B Adam moments) / DP_shard
    offload F         the first F of the optimizer shards' elements live in host memory instead (their main
                      params and moments; megatron's HybridDeviceOptimizer)

``DP_shard`` is the data-parallel group the distributed optimizer shards over: ``DP x CP`` for dense parameters,
the expert-data-parallel size ``world / (PP x EP)`` for routed experts (expert TP 1: the TP ranks are expert-data-
parallel ranks).

Tensor parallelism over ``TP`` ranks (megatron's ``tensor_model_parallel`` attribute) divides by ``TP`` the
parameters it splits: DSv4 attention's head-split tensors (``dsv4_attention.tp.params.HEAD_SPLIT``: ``q_up``, the
sinks (fp32), ``wo_a``, ``wo_b``), the shared expert's and dense MLP's linears, megatron attention's projections
(:func:`hybrid_model.tp_comm.head_split_params`) and the vocab-parallel embedding and head (``V·d / TP``, the
MTP embedding copy too). Everything else (norms, mHC, HyperHeads, q / KV down-projections, compressors, the
indexer, routers, MTP projections) and the routed experts are whole on every TP rank. The learned routers' selection biases
are fp32 buffers (no gradient, no optimizer state). Checked exactly against a built model and optimizer
(``tests/test_memory_model.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_model.config import DSv4ModelConfig
from hybrid_model.mixers.registry import REGISTRY
from hybrid_model.params import hyper_head_params, mhc_params
from hybrid_model.tp_comm import head_split_params


@dataclass(frozen=True)
class StageParams:
    """Parameter elements of one pipeline stage: ``dense_lp`` / ``dense_fp32`` (bf16-able / keep-in-FP32
    parameters, replicated over EP), ``expert`` (routed experts, all of them: divide by EP) and ``buffers``
    (fp32 selection biases: no gradient)."""

    dense_lp: int
    dense_fp32: int
    expert: int
    buffers: int


def _fp32_parts(cfg: DSv4ModelConfig, symbol: str) -> int:
    """Keep-in-FP32 parameters of one layer: its mHC, attention sinks and compressor ``ape`` tensors."""
    n = mhc_params(cfg)
    if symbol in "WCH":
        n += cfg.num_attention_heads  # sinks
        c, ci = cfg.head_dim, cfg.index_head_dim
        if symbol == "C":  # overlapping CSA compressor (2c) and its indexer's (2c_I)
            n += cfg.csa_compress_ratio * 2 * c + cfg.csa_compress_ratio * 2 * ci
        elif symbol == "H":
            n += cfg.hca_compress_ratio * c
    return n


def _tp_split(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(
            f"{what} ({n} parameters) does not divide over --tp {tp}: pick a TP size dividing the heads, output "
            "groups, expert widths and vocabulary"
        )
    return n // tp


def stage_params(cfg: DSv4ModelConfig, pp: int, tp: int = 1) -> list[StageParams]:
    """:class:`StageParams` of one TP rank of each of the ``pp`` stages (the pattern's segments; MTP depths on the
    last stage, the embedding on the first and, with MTP and ``pp > 1``, a copy on the last; the head on the
    last); ``tp``: TP-split parameters divided by ``tp`` (module doc)."""
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    hashed = set(cfg.hash_layer_numbers)
    lp, f32, exp, buf = [0] * pp, [0] * pp, [0] * pp, [0] * pp
    d, V = cfg.hidden_size, cfg.vocab_size
    last = pp - 1
    for li in cfg.layers():
        stage = last if li.mtp_depth else li.stage
        number = li.layer_number if not li.mtp_depth else -li.layer_number
        parts = dict(REGISTRY[li.symbol].params(cfg, number in hashed and not li.mtp_depth).parts)
        routed = parts.pop("moe.routed_experts", 0)
        if "moe.router" in parts and not (number in hashed and not li.mtp_depth):
            parts["moe.router"] -= cfg.n_routed_experts  # the selection bias: a buffer
            buf[stage] += cfg.n_routed_experts
        fp32 = _fp32_parts(cfg, li.symbol)
        sinks = cfg.num_attention_heads if li.symbol in "WCH" else 0
        split = head_split_params(cfg, li.symbol) - sinks  # bf16-able; the sinks are keep-in-FP32
        what = f"layer {li.index} ({li.symbol})"
        lp[stage] += sum(parts.values()) - (fp32 - mhc_params(cfg)) - split + _tp_split(split, tp, what)
        f32[stage] += fp32 - sinks + _tp_split(sinks, tp, f"the sinks of {what}")
        exp[stage] += routed
    depths = cfg.parsed_pattern.mtp_num_depths
    vocab = _tp_split(V * d, tp, "the vocabulary-parallel embedding")
    lp[0] += vocab  # embedding
    lp[last] += vocab + d  # head, final norm
    f32[last] += hyper_head_params(cfg)
    if depths and pp > 1:
        lp[last] += vocab  # the last stage's embedding copy for the MTP depths
    for _ in range(depths):  # e_proj, h_proj, enorm, hnorm, norm; the depth's HyperHead
        lp[last] += 2 * d * d + 3 * d
        f32[last] += hyper_head_params(cfg)
    return [StageParams(lp[i], f32[i], exp[i], buf[i]) for i in range(pp)]


@dataclass(frozen=True)
class StaticMemory:
    """Bytes of one rank between steps, by component."""

    params: float
    grads: float
    main_params: float
    adam: float
    offloaded: float  # host bytes of the offloaded optimizer state (not on the GPU)

    def parts(self) -> dict[str, float]:
        return {
            "parameters": self.params,
            "gradient buffers (fp32 main_grad)": self.grads,
            "fp32 main params (sharded)": self.main_params,
            "Adam moments (sharded)": self.adam,
        }

    @property
    def total(self) -> float:
        return self.params + self.grads + self.main_params + self.adam


def static_memory(
    sp: StageParams,
    *,
    ep: int,
    dp_shard: int,
    expert_dp_shard: int,
    bf16: bool,
    offload_fraction: float = 0.0,
) -> StaticMemory:
    """Bytes of parameters, gradient buffers and optimizer state of one rank holding the stage ``sp`` (module
    doc); ``offload_fraction`` 0 without ``--optimizer-cpu-offload``."""
    if sp.expert % ep:
        raise ValueError(f"the routed experts ({sp.expert} parameters) do not divide over EP={ep}")
    lp, f32, expert = sp.dense_lp, sp.dense_fp32, sp.expert // ep
    p_lp = 2 if bf16 else 4
    params = (lp + expert) * p_lp + (f32 + sp.buffers) * 4
    grads = (lp + expert + f32) * 4.0
    dense_shard, expert_shard = (lp + f32) / dp_shard, expert / expert_dp_shard
    main = ((lp / dp_shard + expert_shard) * 4.0) if bf16 else 0.0
    adam = (dense_shard + expert_shard) * 8.0
    keep = 1.0 - offload_fraction
    return StaticMemory(params, grads, main * keep, adam * keep, (main + adam) * offload_fraction)


__all__ = ["StageParams", "StaticMemory", "stage_params", "static_memory"]
