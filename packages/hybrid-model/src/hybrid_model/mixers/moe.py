"""``E``: DSv4 MoE (hash-moe's ``DSv4MoELayer`` behind an RMSNorm ``ffn_norm``): hash-routed for the first
``num_hash_layers`` ``E`` layers of the main pattern, learned sqrt-softplus top-k after.

Parameters ``E·d`` (gate) ``[+ E`` selection bias, learned layers ``]`` ``+ E·3·d·f`` (routed) ``+ 3·d·f`` per shared
expert ``+ d`` (norm); a token activates ``K`` of the ``E`` routed experts. FLOPs per token ``2·d·E`` (router)
``+ (K + shared)·2·3·d·f``.
"""

from __future__ import annotations

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from dsv4_primitives import RMSNorm
from hash_moe import build_tid2eid_round_robin
from hash_moe.megatron import get_dsv4_moe_spec
from hybrid_model.config import DSv4ModelConfig
from hybrid_model.mixers.record import LayerParams, SymbolRecord
from hybrid_model.symbols import MOE


def moe_layer_spec(*, hash_routing: bool, vocab_size: int | None = None, tid2eid: torch.Tensor | None = None):
    """``TransformerLayer`` spec of an ``E`` layer: ``ffn_norm`` (RMSNorm) + DSv4 MoE (hash or learned router)."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=RMSNorm,
            mlp=get_dsv4_moe_spec(hash_routing=hash_routing, vocab_size=vocab_size, tid2eid=tid2eid),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def hash_moe_layer_spec(cfg: DSv4ModelConfig):
    """The spec of the hash-routed ``E`` layers, with hash-moe's round-robin initial token -> expert table."""
    # the initial table is built on the CPU even under a meta-device build (the router validates its values);
    # int64 so that every hash router converts it into its own int32 buffer (no shared storage)
    with torch.device("cpu"):
        table = build_tid2eid_round_robin(
            cfg.vocab_size, cfg.n_routed_experts, cfg.num_experts_per_tok
        ).long()
    return moe_layer_spec(hash_routing=True, vocab_size=cfg.vocab_size, tid2eid=table)


def one_expert_params(cfg: DSv4ModelConfig) -> int:
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


def moe_params(cfg: DSv4ModelConfig, hashed: bool, active_only: bool = False) -> dict[str, int]:
    E, d = cfg.n_routed_experts, cfg.hidden_size
    n_exp = cfg.num_experts_per_tok if active_only else E
    return {
        "moe.router": E * d + (0 if hashed else E),
        "moe.routed_experts": n_exp * one_expert_params(cfg),
        "moe.shared_experts": cfg.n_shared_experts * one_expert_params(cfg),
    }


def _spec(cfg: DSv4ModelConfig, backend, is_mtp: bool):
    return moe_layer_spec(hash_routing=False)


def _params(cfg: DSv4ModelConfig, hashed: bool) -> LayerParams:
    parts = {**moe_params(cfg, hashed), "norms": cfg.hidden_size}  # + ffn_norm
    return LayerParams(parts, parts["moe.routed_experts"] - cfg.num_experts_per_tok * one_expert_params(cfg))


def moe_flops(cfg: DSv4ModelConfig) -> int:
    """Forward FLOPs per token: the router and the ``K`` routed + the shared experts' SwiGLU MLPs."""
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    return 2 * d * cfg.n_routed_experts + (cfg.num_experts_per_tok + cfg.n_shared_experts) * 2 * 3 * d * f


RECORD = SymbolRecord(
    symbol=MOE,
    layer="DSv4 MoE",
    spec=_spec,
    build_keywords=frozenset({"is_mtp_layer", "add_layer_offset"}),
    params=_params,
    flops=lambda cfg: {"moe": moe_flops(cfg)},
)
