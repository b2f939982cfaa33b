"""Shared builders for the megatron-level tests (tiny DSv4 MoE configs and a full fp64 weight set)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

HIDDEN, FFN, SHARED_FFN, EXPERTS, TOPK, VOCAB = 16, 8, 12, 4, 2, 37


def make_config(*, ep: int = 1, limit: float | None = 0.5, balance: float = 1e-2, dtype=torch.float64, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=FFN,
        moe_shared_expert_intermediate_size=SHARED_FFN,
        moe_token_dispatcher_type="allgather",
        moe_router_score_function="sqrtsoftplus",
        moe_router_topk_scaling_factor=1.5,
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-3,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=balance,
        activation_func_clamp_value=limit,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        params_dtype=dtype,
        expert_model_parallel_size=ep,
        use_cpu_initialization=True,
    )
    args.update(kw)
    return TransformerConfig(**args)


def full_weights(seed: int = 0, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """Weights of all ``EXPERTS`` experts, the gate and the shared expert (scaled so the clamps at 0.5 bite)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=0.5: (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(dtype)
    return {
        "gate": r(EXPERTS, HIDDEN),
        "gate_up": r(EXPERTS, 2 * FFN, HIDDEN),
        "down": r(EXPERTS, HIDDEN, FFN),
        "shared_gate": r(SHARED_FFN, HIDDEN),
        "shared_up": r(SHARED_FFN, HIDDEN),
        "shared_down": r(HIDDEN, SHARED_FFN),
        "bias": r(EXPERTS, scale=0.05).float(),
    }


@torch.no_grad()
def load_weights(layer, w: dict[str, torch.Tensor], local_experts: list[int]) -> None:
    layer.router.weight.copy_(w["gate"])
    layer.experts.gate_up_proj.copy_(w["gate_up"][local_experts])
    layer.experts.down_proj.copy_(w["down"][local_experts])
    layer.shared_experts.linear_gate.weight.copy_(w["shared_gate"])
    layer.shared_experts.linear_up.weight.copy_(w["shared_up"])
    layer.shared_experts.linear_down.weight.copy_(w["shared_down"])
    if hasattr(layer.router, "e_score_correction_bias"):
        layer.router.e_score_correction_bias.copy_(w["bias"])


def tid2eid_table() -> torch.Tensor:
    from hash_moe import build_tid2eid_balanced

    counts = torch.arange(VOCAB, dtype=torch.float64) % 7 + 1
    return build_tid2eid_balanced(counts, EXPERTS, TOPK, seed=3)
