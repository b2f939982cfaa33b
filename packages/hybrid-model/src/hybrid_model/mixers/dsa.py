"""``D``: megatron-core's DSA layer (``AbsorbedMLASelfAttention`` + ``DSAttention`` + its indexer): TE spec or
local spec as ``+`` (:mod:`hybrid_model.latent_attention`); shared sizes in :mod:`hybrid_model.mixers.latent`.

Beyond MLA's parameters the indexer has ``n_I·c_I·d_c + c_I·d + 2·c_I + n_I·d`` (``wq_b``, ``wk``, LayerNorm
k-norm, weights) and costs ``2·(d_c·n_I·c_I + d·c_I + d·n_I)`` FLOPs per token; the core ``2·n_h·(2c - r)`` per
selected pair (``q·k`` over ``L + r`` latent dims, ``p·v`` over ``L``) and the indexer ``2·n_I·c_I + 2·n_I`` per
causal pair.
"""

from __future__ import annotations

from hybrid_model.config import DSv4ModelConfig
from hybrid_model.mixers.dsv4_kinds import index_per_pair
from hybrid_model.mixers.latent import latent_params, latent_projection_flops, latent_record
from hybrid_model.mixers.record import LayerParams, Pairs
from hybrid_model.symbols import DSA


def dsa_indexer_params(cfg: DSv4ModelConfig) -> int:
    nI, cI = cfg.index_n_heads, cfg.index_head_dim
    return nI * cI * cfg.q_lora_rank + cI * cfg.hidden_size + 2 * cI + nI * cfg.hidden_size


def dsa_indexer_flops(cfg: DSv4ModelConfig) -> int:
    """megatron's DSA indexer ``linear_wq_b`` (d_c -> n_I·c_I), ``linear_wk`` (d -> c_I), weights (d -> n_I)."""
    d, nI, cI = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
    return 2 * (cfg.q_lora_rank * nI * cI + d * cI + d * nI)


def dsa_core_per_pair(cfg: DSv4ModelConfig) -> int:
    """Absorbed MLA: ``q·k`` over ``L + r = c`` latent dims and ``p·v`` over ``L = c - r``, ``n_h`` heads."""
    c, r = cfg.head_dim, cfg.qk_rope_head_dim
    return 2 * cfg.num_attention_heads * (2 * c - r)


def _params(cfg: DSv4ModelConfig, hashed: bool) -> LayerParams:
    parts = {**latent_params(cfg), "attention.indexer": dsa_indexer_params(cfg), "norms": cfg.hidden_size}
    return LayerParams(parts)


def _flops(cfg: DSv4ModelConfig) -> dict[str, int]:
    return {
        "attention.projections": latent_projection_flops(cfg),
        "attention.indexer": dsa_indexer_flops(cfg),
    }


def _core_flops(cfg: DSv4ModelConfig, pairs: Pairs) -> dict[str, float]:
    return {
        "attention.dsa_core": dsa_core_per_pair(cfg) * pairs.dsa,
        "attention.indexer_scores": index_per_pair(cfg) * pairs.causal,
    }


RECORD = latent_record(DSA, "DSA", params=_params, flops=_flops, core_flops=_core_flops, core_pass=2)
