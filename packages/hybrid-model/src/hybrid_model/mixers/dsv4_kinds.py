"""What DSv4's attention symbols ``W`` / ``C`` / ``H`` share: one record per :class:`dsv4_attention.LayerKind`.

The layer is dsv4-attention's ``DSv4TransformerLayer`` (RMSNorm ``attn_norm`` + ``DSv4HybridAttention``) of the
kind, from :func:`dsv4_attention.megatron.get_dsv4_layer_spec`. Parameters (``d`` hidden, ``c`` head dim, ``n_h``
heads, ``d_c`` q rank, ``g``/``d_g`` output groups/rank, ``n_I``/``c_I`` indexer heads/dim, ``m``/``m'`` ratios)::

    attention      = d_c·d + d_c + n_h·c·d_c + c·d + c + n_h + g·d_g·(n_h·c/g) + d·g·d_g
    CSA compressor = 2·(2c·d) + m·2c + c          HCA compressor = 2·(c·d) + m'·c + c
    indexer        = n_I·c_I·d_c + n_I·d + 2·(2c_I·d) + m·2c_I + c_I

FLOPs per token ``2·(d·d_c + d_c·n_h·c + d·c + n_h·c·d_g + g·d_g·d)`` (projections), compressor CSA ``2·2·(2c)·d``,
HCA ``2·2·c·d``, indexer ``2·(d_c·n_I·c_I + d·n_I) + 2·2·(2c_I)·d``; cores ``4·n_h·c`` per window / selected /
visible compressed pair, the indexer ``2·n_I·c_I + 2·n_I`` per visible compressed entry (:mod:`hybrid_model.flops`).
"""

from __future__ import annotations

from dsv4_attention import LayerKind
from dsv4_attention.megatron import get_dsv4_layer_spec
from hybrid_model.config import DSv4ModelConfig
from hybrid_model.mixers.record import LayerParams, Pairs, SymbolRecord


def attention_params(cfg: DSv4ModelConfig, kind: LayerKind | int) -> dict[str, int]:
    """Per-layer attention parameter counts by part for a layer of ``kind`` (a :class:`LayerKind` or its ratio)."""
    kind = LayerKind.coerce(kind)
    d, c, nh, dc = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.q_lora_rank
    g, dg = cfg.o_groups, cfg.o_lora_rank
    out = {
        "attention.projections": dc * d + dc + nh * c * dc + c * d + c + g * dg * (nh * c // g) + d * g * dg,
        "attention.sinks": nh,
        "attention.compressor": 0,
        "attention.indexer": 0,
    }
    m = kind.compress_ratio
    if kind.has_indexer:  # CSA: overlapping compressors (two series) for the KV and the indexer keys
        nI, cI = cfg.index_n_heads, cfg.index_head_dim
        out["attention.compressor"] = 2 * (2 * c * d) + m * 2 * c + c
        out["attention.indexer"] = nI * cI * dc + nI * d + 2 * (2 * cI * d) + m * 2 * cI + cI
    elif kind.has_compressor:
        out["attention.compressor"] = 2 * c * d + m * c + c
    return out


def projection_flops(cfg: DSv4ModelConfig) -> int:
    """Forward FLOPs per token of the q / kv / grouped output projections."""
    d, c, nh, dc = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.q_lora_rank
    return 2 * (d * dc + dc * nh * c + d * c + nh * c * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d)


def compressor_flops(cfg: DSv4ModelConfig, kind: LayerKind) -> int:
    """Forward FLOPs per token of the compressor's projections (0 without a compressor)."""
    if not kind.has_compressor:
        return 0
    coff = 2 if kind.overlap else 1  # CSA pools two overlapping series
    return 2 * 2 * (coff * cfg.head_dim) * cfg.hidden_size


def indexer_flops(cfg: DSv4ModelConfig) -> int:
    """Forward FLOPs per token of the lightning indexer's projections (CSA)."""
    d, nI, cI = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
    return 2 * (cfg.q_lora_rank * nI * cI + d * nI) + 2 * 2 * (2 * cI) * d


def core_per_pair(cfg: DSv4ModelConfig) -> int:
    """``q·k`` and ``p·v`` of one (query, key) pair over ``n_h`` heads of ``c`` dims (also MLA's ``+`` core)."""
    return 4 * cfg.num_attention_heads * cfg.head_dim


def index_per_pair(cfg: DSv4ModelConfig) -> int:
    """The indexer's scores of one (query, entry) pair (also DSA's ``D`` indexer)."""
    return 2 * cfg.index_n_heads * cfg.index_head_dim + 2 * cfg.index_n_heads


def kind_record(kind: LayerKind, layer: str) -> SymbolRecord:
    """The record of the attention symbol of ``kind``."""

    def spec(cfg: DSv4ModelConfig, backend, is_mtp: bool):
        return get_dsv4_layer_spec(kind, backend, is_mtp_layer=is_mtp)

    def params(cfg: DSv4ModelConfig, hashed: bool) -> LayerParams:
        return LayerParams({**attention_params(cfg, kind), "norms": cfg.hidden_size})  # + attn_norm

    def flops(cfg: DSv4ModelConfig) -> dict[str, int]:
        out = {"attention.projections": projection_flops(cfg)}
        if kind.has_compressor:
            out["attention.compressor"] = compressor_flops(cfg, kind)
        if kind.has_indexer:
            out["attention.indexer"] = indexer_flops(cfg)
        return out

    def core_flops(cfg: DSv4ModelConfig, pairs: Pairs) -> dict[str, float]:
        out = {"attention.window_core": core_per_pair(cfg) * pairs.window}
        if kind is LayerKind.CSA:
            out["attention.csa_core"] = core_per_pair(cfg) * pairs.csa
            out["attention.indexer_scores"] = index_per_pair(cfg) * pairs.indexer
        elif kind is LayerKind.HCA:
            out["attention.hca_core"] = core_per_pair(cfg) * pairs.hca
        return out

    return SymbolRecord(
        symbol=kind.symbol,
        layer=layer,
        spec=spec,
        build_keywords=frozenset({"is_mtp_layer", "pp_layer_offset", "add_layer_offset"}),
        params=params,
        flops=flops,
        core_flops=core_flops,
        core_pass=3,
    )
