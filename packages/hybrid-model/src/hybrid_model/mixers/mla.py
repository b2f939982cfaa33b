"""``+``: megatron-core's MLA layer (``MLASelfAttention``): its TE spec with transformer-engine, the local spec of
the same math without (:mod:`hybrid_model.latent_attention`); sizes and counts in :mod:`hybrid_model.mixers.latent`.
Its core costs ``4·n_h·c`` FLOPs per causal (query, key) pair."""

from __future__ import annotations

from hybrid_model.config import DSv4ModelConfig
from hybrid_model.mixers.dsv4_kinds import core_per_pair
from hybrid_model.mixers.latent import latent_params, latent_projection_flops, latent_record
from hybrid_model.mixers.record import LayerParams, Pairs
from hybrid_model.symbols import MLA


def _params(cfg: DSv4ModelConfig, hashed: bool) -> LayerParams:
    return LayerParams({**latent_params(cfg), "norms": cfg.hidden_size})  # + input_layernorm


def _core_flops(cfg: DSv4ModelConfig, pairs: Pairs) -> dict[str, float]:
    return {"attention.causal_core": core_per_pair(cfg) * pairs.causal}


RECORD = latent_record(
    MLA,
    "MLA",
    params=_params,
    flops=lambda cfg: {"attention.projections": latent_projection_flops(cfg)},
    core_flops=_core_flops,
    core_pass=1,
)
