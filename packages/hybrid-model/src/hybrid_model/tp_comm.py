"""Communication of tensor parallelism with sequence parallelism, per layer and rank (issue 31): which collectives
one micro-batch's forward and backward run over the TP group, how large they are, and the bytes a rank moves.

A TP group of ``P`` ranks holds ``T`` rows (``micro_batch · seq_len / CP``; SP: rank ``r`` has rows ``[r·L,
(r+1)·L)``, ``L = T / P``). ``b`` bytes per activation element (2 bf16, 4 fp32); ``d`` hidden, ``c`` head dim,
``d_c`` q rank, ``c_I`` indexer head dim, ``k`` top-k, ``m``/``m'`` CSA/HCA ratios, ``E`` routed experts, ``D``
sequences per micro-batch. Every collective is described by its FULL tensor (the gathered output, the
reduce-scattered input, the all-reduced or all-to-all buffer) of ``N`` elements; a rank sends and receives (ring
algorithm, NCCL's bus bytes) ``(P-1)/P · N`` elements for an all-gather, reduce-scatter or all-to-all and
``2·(P-1)/P · N`` for an all-reduce (:meth:`Collective.bytes_per_rank`). Per micro-batch:

    DSv4 attention W / C / H (dsv4_attention.tp; h = min(max(n_win - 1, d_comp), L), d_comp 0 / 7 / 127)
      forward   all-gather     halo rows               P·h · d                 b
                all-gather     C: entries + keys       P·(L//m + 1) · (c + c_I) b     H: P·(L//m' + 1) · c
                all-gather     q latent + KV           T · (d_c + c)           b
                all-gather     C: top-k ids            T · k                   int32 (sparse phase)
                all-to-all     C: teacher log-mass     T · K                   fp32 (K = k sparse, T//m dense)
                reduce-scatter output (wo_b partial)   T · d                   b
      backward  all-gather     output gradient         T · d                   b
                reduce-scatter entries, latent + KV, halo (the forward's shapes, b)
    MoE E       the shared expert's megatron linears (gate and up column-parallel, each gathering its input; down
                row-parallel); the routed experts run whole on each rank's rows (expert TP 1): no TP collective
      forward   2 all-gather T·d, 1 reduce-scatter T·d (b); learned routers: all-reduce of the balance loss's
                counts D·E and lengths D (fp32, over TP x CP)
      backward  1 all-gather T·d (down's output gradient), per column linear 1 all-gather T·d (its input again,
                for the weight gradient: megatron keeps only the rank's rows) + 1 reduce-scatter T·d
    MLP - , *   one column- and one row-parallel linear (megatron's attention: linear_qkv, linear_proj): forward 1 all-gather + 1 reduce-scatter of T·d;
                backward 2 all-gathers + 1 reduce-scatter of T·d (b)
    mHC         none: the streams [L, n·d] and every per-token mix stay on the rank
    embedding   forward reduce-scatter T·d (the vocab-parallel lookup's partial sums); backward all-gather T·d
    head        fused linear cross entropy (default): forward all-gather of the input T·d (b), all-reduce MAX T,
                all-reduce SUM 2·T (the vocab shards' statistics, fp32), all-reduce T·d fp32 (the input gradient,
                formed in the forward); backward all-reduce of one int32 (the upstream-gradient check).
                Unfused (megatron's output layer): forward all-gather T·d, all-reduce MAX T, SUM 2·T (fp32);
                backward all-gather T·d (input for dW) + reduce-scatter T·d
    MTP depth   its embedding, its layers and the head, as above
    per step    all-reduce of the replicated (sequence-parallel) parameters' fp32 gradients over TP
                (megatron's finalize_model_grads), once per step, not per micro-batch: :func:`replicated_params`

The forward / backward collectives of every layer kind are checked exactly (op, shape, dtype) against those a
gloo TP2 run of the tiny model calls (``tests/test_tp_comm.py``). Not counted: scalar reductions outside the layers
(loss token counts, logged metrics), the routed experts' gradient reduction over the expert-data-parallel group
(which spans the TP ranks under expert TP 1: a data-parallel collective), and the CP collectives under TP x CP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybrid_model.config import DSv4ModelConfig
from hybrid_model.mixers.registry import REGISTRY
from hybrid_model.params import mhc_params

Op = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]
Phase = Literal["forward", "backward"]
OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
SYMBOLS = "WCHE-*"


@dataclass(frozen=True)
class Collective:
    """One collective over the TP group: ``what`` moves, ``op``, ``elements`` of the full tensor (module doc),
    ``itemsize`` bytes per element, ``phase``."""

    what: str
    op: Op
    elements: int
    itemsize: int
    phase: Phase

    def bytes_per_rank(self, tp: int) -> float:
        """Bytes one rank sends (and receives) in a ring: ``(P-1)/P · N · itemsize``, twice that for an
        all-reduce."""
        share = (tp - 1) / tp * self.elements * self.itemsize
        return 2 * share if self.op == "all_reduce" else share


def _rows(tokens: int, tp: int) -> int:
    if tp < 1 or tokens % tp:
        raise ValueError(
            f"sequence parallelism over {tp} TP ranks needs the rows per TP group ({tokens}) to be a multiple of "
            f"the TP size: pick --seq-len as a multiple of --tp x --cp"
        )
    return tokens // tp


def _halo(cfg: DSv4ModelConfig, symbol: str, rows: int) -> int:
    # rows left of a rank's slice its compressor reads: the overlapping CSA groups 2m - 1, HCA m' - 1
    comp = {"W": 0, "C": 2 * cfg.csa_compress_ratio - 1, "H": cfg.hca_compress_ratio - 1}[symbol]
    return min(max(cfg.sliding_window - 1, comp), rows)


def attention_collectives(
    cfg: DSv4ModelConfig, symbol: str, tokens: int, tp: int, *, b: int = 2, sparse: bool = True
) -> list[Collective]:
    """The TP collectives of one DSv4 attention layer ``symbol`` (``W``, ``C``, ``H``) on ``tokens`` rows."""
    rows = _rows(tokens, tp)
    d, c, dc = cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank
    halo = tp * _halo(cfg, symbol, rows) * d
    out = [Collective("halo rows", "all_gather", halo, b, "forward")]
    entries = 0
    if symbol == "C":
        entries = tp * (rows // cfg.csa_compress_ratio + 1) * (c + cfg.index_head_dim)
        out.append(Collective("compressed entries + indexer keys", "all_gather", entries, b, "forward"))
    elif symbol == "H":
        entries = tp * (rows // cfg.hca_compress_ratio + 1) * c
        out.append(Collective("compressed entries", "all_gather", entries, b, "forward"))
    out.append(Collective("q latent + KV", "all_gather", tokens * (dc + c), b, "forward"))
    if symbol == "C":
        if sparse:
            out.append(Collective("top-k ids", "all_gather", tokens * cfg.index_topk, 4, "forward"))
        width = cfg.index_topk if sparse else tokens // cfg.csa_compress_ratio
        out.append(Collective("indexer teacher log-mass", "all_to_all", tokens * width, 4, "forward"))
    out.append(Collective("output (wo_b partial)", "reduce_scatter", tokens * d, b, "forward"))
    out.append(Collective("output gradient", "all_gather", tokens * d, b, "backward"))
    if entries:
        out.append(Collective("entry gradients", "reduce_scatter", entries, b, "backward"))
    out.append(Collective("q latent + KV gradients", "reduce_scatter", tokens * (dc + c), b, "backward"))
    out.append(Collective("halo gradients", "reduce_scatter", halo, b, "backward"))
    return out


def _column_row(tokens: int, d: int, b: int, columns: int, what: str) -> list[Collective]:
    """megatron's ``columns`` column-parallel linears on one input and a row-parallel linear after them (SP)."""
    n = tokens * d
    fwd = [Collective(f"{what} input", "all_gather", n, b, "forward") for _ in range(columns)]
    fwd.append(Collective(f"{what} output", "reduce_scatter", n, b, "forward"))
    bwd = [Collective(f"{what} output gradient", "all_gather", n, b, "backward")]
    for _ in range(columns):
        bwd.append(Collective(f"{what} input again (weight gradient)", "all_gather", n, b, "backward"))
        bwd.append(Collective(f"{what} input gradient", "reduce_scatter", n, b, "backward"))
    return fwd + bwd


def moe_collectives(
    cfg: DSv4ModelConfig, tokens: int, tp: int, *, b: int = 2, learned: bool = True, sequences: int = 1
) -> list[Collective]:
    """One MoE layer ``E``: the shared expert's linears; a learned router's balance-loss counts."""
    _rows(tokens, tp)
    out = _column_row(tokens, cfg.hidden_size, b, 2, "shared expert") if cfg.n_shared_experts else []
    if learned:
        out.append(
            Collective("balance-loss counts", "all_reduce", sequences * cfg.n_routed_experts, 4, "forward")
        )
        out.append(Collective("balance-loss lengths", "all_reduce", sequences, 4, "forward"))
    return out


def mlp_collectives(cfg: DSv4ModelConfig, tokens: int, tp: int, *, b: int = 2) -> list[Collective]:
    """One dense MLP ``-`` (megatron's fused gate/up column-parallel ``linear_fc1``, row-parallel ``linear_fc2``)."""
    _rows(tokens, tp)
    return _column_row(tokens, cfg.hidden_size, b, 1, "MLP")


def embedding_collectives(cfg: DSv4ModelConfig, tokens: int, tp: int, *, b: int = 2) -> list[Collective]:
    _rows(tokens, tp)
    n = tokens * cfg.hidden_size
    return [
        Collective("embedding partial sums", "reduce_scatter", n, b, "forward"),
        Collective("embedding gradient", "all_gather", n, b, "backward"),
    ]


def head_collectives(
    cfg: DSv4ModelConfig, tokens: int, tp: int, *, b: int = 2, fused: bool = True
) -> list[Collective]:
    """One output head and its loss (the main head or an MTP depth's: the head is shared)."""
    _rows(tokens, tp)
    n = tokens * cfg.hidden_size
    out = [
        Collective("head input", "all_gather", n, b, "forward"),
        Collective("vocab-shard max", "all_reduce", tokens, 4, "forward"),
        Collective("vocab-shard sum + target logit", "all_reduce", 2 * tokens, 4, "forward"),
    ]
    if fused:
        out.append(Collective("head input gradient (fp32)", "all_reduce", n, 4, "forward"))
        out.append(Collective("upstream-gradient check", "all_reduce", 1, 4, "backward"))
    else:
        out.append(Collective("head input again (weight gradient)", "all_gather", n, b, "backward"))
        out.append(Collective("head input gradient", "reduce_scatter", n, b, "backward"))
    return out


def layer_collectives(
    cfg: DSv4ModelConfig,
    symbol: str,
    tokens: int,
    tp: int,
    *,
    b: int = 2,
    learned: bool = True,
    sparse: bool = True,
    sequences: int = 1,
) -> list[Collective]:
    """The TP collectives of one layer ``symbol`` (``W C H E -``; ``learned``: an ``E`` with a learned router)."""
    if symbol in "WCH":
        return attention_collectives(cfg, symbol, tokens, tp, b=b, sparse=sparse)
    if symbol == "E":
        return moe_collectives(cfg, tokens, tp, b=b, learned=learned, sequences=sequences)
    if symbol in "-*":
        return mlp_collectives(cfg, tokens, tp, b=b)  # * : linear_qkv column-, linear_proj row-parallel
    raise ValueError(
        f"the TP communication model covers the symbols {SYMBOLS!r}; {symbol!r} is not modelled: use a pattern of "
        "those"
    )


def head_split_params(cfg: DSv4ModelConfig, symbol: str) -> int:
    """Parameters of one layer ``symbol`` split over TP (all ranks together): DSv4 attention's ``q_up``, sinks,
    grouped ``wo_a`` and ``wo_b``; the shared expert's and the MLP's linears. The rest is replicated."""
    d, c, nh = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    if symbol in "WCH":
        return nh * c * cfg.q_lora_rank + nh + nh * c * cfg.o_lora_rank + d * cfg.o_groups * cfg.o_lora_rank
    parts = REGISTRY[symbol].params(cfg, False).parts
    if symbol == "*":
        return parts["attention.projections"]
    return parts.get("moe.shared_experts", 0) + parts.get("mlp", 0)


def replicated_params(cfg: DSv4ModelConfig, symbol: str, hashed: bool = False) -> int:
    """Parameters of one layer ``symbol`` replicated on every TP rank, mHC included (their fp32 gradients are
    all-reduced over TP once per step); routed experts excluded (expert TP 1: reduced over expert DP)."""
    parts = dict(REGISTRY[symbol].params(cfg, hashed).parts)
    parts.pop("moe.routed_experts", 0)
    if "moe.router" in parts and not hashed:
        parts["moe.router"] -= cfg.n_routed_experts  # the selection bias: a buffer, no gradient
    return sum(parts.values()) - head_split_params(cfg, symbol) + mhc_params(cfg)


def total_bytes(collectives: list[Collective], tp: int, phase: Phase | None = None) -> float:
    """Bytes one rank sends (= receives) over ``collectives`` (of ``phase`` only, when given)."""
    return sum(x.bytes_per_rank(tp) for x in collectives if phase is None or x.phase == phase)


__all__ = [
    "OPS",
    "SYMBOLS",
    "Collective",
    "attention_collectives",
    "embedding_collectives",
    "head_collectives",
    "head_split_params",
    "layer_collectives",
    "mlp_collectives",
    "moe_collectives",
    "replicated_params",
    "total_bytes",
]
