"""``*``: standard softmax attention (megatron's ``SelfAttention`` with its own RoPE and a causal core,
:mod:`hybrid_model.standard_attention`) behind an RMSNorm ``input_layernorm``.

``n_h`` heads of ``d / n_h`` dims: ``4·d² + d`` parameters (QKV, output; norm), ``2·4·d²`` FLOPs per token plus
``4·d`` per causal (query, key) pair. No context parallelism.
"""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from dsv4_primitives import RMSNorm
from hybrid_model.config import DSv4ModelConfig
from hybrid_model.mixers.record import HOST_BOUNDARIES, LayerParams, Layout, Pairs, Refusal, SymbolRecord
from hybrid_model.standard_attention import CP_REFUSAL, CausalSoftmaxAttention, StandardSelfAttention
from hybrid_model.symbols import ATTENTION


def attention_layer_spec(model_config: DSv4ModelConfig, backend):
    """``*``: ``TransformerLayer`` with RMSNorm ``input_layernorm`` + :class:`StandardSelfAttention`."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=ModuleSpec(
                module=StandardSelfAttention,
                params={
                    "attn_mask_type": AttnMaskType.causal,
                    "rope_base": model_config.rope_theta,
                    "rotary_percent": model_config.qk_rope_head_dim / model_config.head_dim,
                },
                submodules=SelfAttentionSubmodules(
                    linear_qkv=backend.column_parallel_linear(),
                    core_attention=CausalSoftmaxAttention,
                    linear_proj=backend.row_parallel_linear(),
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
        ),
    )


def standard_core_per_pair(cfg: DSv4ModelConfig) -> int:
    """``q·k`` and ``p·v`` over ``n_h`` heads of ``d / n_h`` dims = ``4·d`` per (query, key) pair."""
    return 4 * cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)


def _params(cfg: DSv4ModelConfig, hashed: bool) -> LayerParams:
    d = cfg.hidden_size  # QKV d -> 3d and output d -> d, no biases; + its norm
    return LayerParams({"attention.projections": 4 * d * d, "norms": d})


def _core_flops(cfg: DSv4ModelConfig, pairs: Pairs) -> dict[str, float]:
    return {"attention.causal_core": standard_core_per_pair(cfg) * pairs.causal}


RECORD = SymbolRecord(
    symbol=ATTENTION,
    layer="standard attention",
    spec=lambda cfg, backend, is_mtp: attention_layer_spec(cfg, backend),
    build_keywords=frozenset({"is_mtp_layer", "pp_layer_offset", "add_layer_offset"}),
    refusals=(Refusal(Layout.CP, CP_REFUSAL), HOST_BOUNDARIES),
    params=_params,
    flops=lambda cfg: {"attention.projections": 8 * cfg.hidden_size * cfg.hidden_size},
    core_flops=_core_flops,
    core_pass=0,
)
