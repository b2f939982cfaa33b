"""megatron-core 0.19.2 integration of hash-moe: routers, experts, the MoE layer, its spec, the bias step.

Importing this subpackage imports megatron-core; the math in :mod:`hash_moe` does not need it.
"""

from hash_moe.megatron.bias_update import update_selection_biases
from hash_moe.megatron.experts import ClampedSwiGLUExperts, ClampedSwiGLUSharedExpert
from hash_moe.megatron.moe_layer import DSv4MoELayer
from hash_moe.megatron.router import (
    HashRouter,
    LearnedTopKRouter,
    balance_loss_coeff_from_transformer_config,
    router_config_from_transformer_config,
)
from hash_moe.megatron.spec import get_dsv4_moe_spec
from hash_moe.megatron.token_dispatcher import DSv4AlltoAllTokenDispatcher

__all__ = [
    "ClampedSwiGLUExperts",
    "ClampedSwiGLUSharedExpert",
    "DSv4AlltoAllTokenDispatcher",
    "DSv4MoELayer",
    "HashRouter",
    "LearnedTopKRouter",
    "balance_loss_coeff_from_transformer_config",
    "get_dsv4_moe_spec",
    "router_config_from_transformer_config",
    "update_selection_biases",
]
