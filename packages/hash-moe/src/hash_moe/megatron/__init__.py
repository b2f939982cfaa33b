"""megatron-core 0.19.2 integration of hash-moe: routers, experts, the MoE layer, its spec, the bias step.

Importing this subpackage imports megatron-core; the math in :mod:`hash_moe` does not need it. Needs the
``[megatron]`` extra (``pip install 'hash-moe[megatron]'``): without megatron-core the import raises an
``ImportError`` naming it.
"""

from dsv4_primitives.extras import require_megatron

require_megatron("hash-moe[megatron]", "hash_moe.megatron")

from hash_moe.megatron.bias_update import update_selection_biases  # noqa: E402
from hash_moe.megatron.experts import ClampedSwiGLUExperts, ClampedSwiGLUSharedExpert  # noqa: E402
from hash_moe.megatron.moe_layer import DSv4MoELayer, release_forward_state  # noqa: E402
from hash_moe.megatron.router import (  # noqa: E402
    HashRouter,
    LearnedTopKRouter,
    balance_loss_coeff_from_transformer_config,
    router_config_from_transformer_config,
)
from hash_moe.megatron.spec import get_dsv4_moe_spec  # noqa: E402
from hash_moe.megatron.token_dispatcher import DSv4AlltoAllTokenDispatcher  # noqa: E402

__all__ = [
    "ClampedSwiGLUExperts",
    "ClampedSwiGLUSharedExpert",
    "DSv4AlltoAllTokenDispatcher",
    "DSv4MoELayer",
    "HashRouter",
    "LearnedTopKRouter",
    "balance_loss_coeff_from_transformer_config",
    "get_dsv4_moe_spec",
    "release_forward_state",
    "router_config_from_transformer_config",
    "update_selection_biases",
]
