"""``-``: a dense SwiGLU MLP (megatron's ``MLP`` in a ``TransformerLayer`` with an RMSNorm ``pre_mlp_layernorm``),
of width ``f = moe_intermediate_size``: ``3·d·f + d`` parameters, ``2·3·d·f`` FLOPs per token."""

from __future__ import annotations

import functools

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.mlp import MLP as MegatronMLP
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from dsv4_primitives import RMSNorm
from hybrid_model.config import DSv4ModelConfig
from hybrid_model.mixers.moe import one_expert_params
from hybrid_model.mixers.record import LayerParams, SymbolRecord
from hybrid_model.symbols import MLP


def mlp_layer_spec(backend):
    """``-``: ``TransformerLayer`` with RMSNorm ``pre_mlp_layernorm`` and megatron's dense (SwiGLU) ``MLP``."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=RMSNorm,
            # megatron's own specs' form (a ModuleSpec of MLP is rewrapped into this, with a warning per layer)
            mlp=functools.partial(
                MegatronMLP.as_mlp_submodule,
                submodules=MLPSubmodules(
                    linear_fc1=backend.column_parallel_linear(), linear_fc2=backend.row_parallel_linear()
                ),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def _params(cfg: DSv4ModelConfig, hashed: bool) -> LayerParams:
    # SwiGLU MLP d -> 2f -> d, no biases; + its norm
    return LayerParams({"mlp": one_expert_params(cfg), "norms": cfg.hidden_size})


RECORD = SymbolRecord(
    symbol=MLP,
    layer="dense SwiGLU MLP",
    spec=lambda cfg, backend, is_mtp: mlp_layer_spec(backend),
    params=_params,
    flops=lambda cfg: {"mlp": 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size},
)
