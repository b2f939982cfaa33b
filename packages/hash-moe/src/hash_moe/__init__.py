"""hash-moe: DeepSeek-V4 MoE routing and experts (P4 hash routing, sqrt-softplus top-k, P5 clamped SwiGLU, P10).

The math (this namespace) is plain PyTorch; the megatron-core integration lives in :mod:`hash_moe.megatron`.
See the package README for the API table.
"""

from hash_moe.balance import (
    sequence_balance_loss,
    sequence_ids_from_cu_seqlens,
    tokens_per_expert,
    update_selection_bias_,
)
from hash_moe.experts import grouped_swiglu_experts, swiglu_mlp
from hash_moe.grouped_gemm import grouped_mm, grouped_mm_loop
from hash_moe.hash_table import (
    build_tid2eid_balanced,
    build_tid2eid_round_robin,
    load_tid2eid,
    validate_tid2eid,
)
from hash_moe.layer_schedule import hash_moe_layer_flags, hash_moe_layer_numbers
from hash_moe.permute import (
    PermuteMap,
    build_permute_map,
    permute,
    permute_ref,
    unpermute,
    unpermute_ref,
)
from hash_moe.reference import moe_reference
from hash_moe.routed_experts import routed_mm, routed_swiglu_experts
from hash_moe.routing import (
    RouterConfig,
    RoutingResult,
    dense_routing,
    hash_route,
    token_ids_checked,
    topk_route,
)
from hash_moe.scores import SCORE_FUNCTIONS, routing_scores
from hash_moe.swiglu import clamped_swiglu, clamped_swiglu_ref

__version__ = "0.7.5"

__all__ = [
    "SCORE_FUNCTIONS",
    "PermuteMap",
    "RouterConfig",
    "RoutingResult",
    "__version__",
    "build_permute_map",
    "build_tid2eid_balanced",
    "build_tid2eid_round_robin",
    "clamped_swiglu",
    "clamped_swiglu_ref",
    "dense_routing",
    "grouped_mm",
    "grouped_mm_loop",
    "grouped_swiglu_experts",
    "hash_moe_layer_flags",
    "hash_moe_layer_numbers",
    "hash_route",
    "load_tid2eid",
    "moe_reference",
    "permute",
    "permute_ref",
    "routed_mm",
    "routed_swiglu_experts",
    "routing_scores",
    "sequence_balance_loss",
    "sequence_ids_from_cu_seqlens",
    "swiglu_mlp",
    "token_ids_checked",
    "tokens_per_expert",
    "topk_route",
    "unpermute",
    "unpermute_ref",
    "update_selection_bias_",
    "validate_tid2eid",
]
