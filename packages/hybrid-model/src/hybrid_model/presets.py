"""Named model presets: ``tiny`` (CPU, every structural feature), ``v4-flash``, ``v4-pro``, ``flash-smoke``.

* ``tiny``: spec §9.4 (``W C H C H C`` + MTP ``W``, window 8, HCA ratio 128 instead of 8: the attention package
  accepts only the released ratios, mHC n=4, 8 experts top-2 + shared,
  2 hash layers) — trains on 2 CPU cores in minutes.
* ``v4-flash`` / ``v4-pro``: the released shapes (§9.1); buildable on the meta device for counting.
* ``flash-smoke``: one GPU, real per-layer Flash shapes: 4 blocks ``W C H C`` each with MoE, 16 routed experts
  top-6 + 1 shared, the first MoE layer hashed, mHC n=4, vocab 129280, plus MTP.
"""

from __future__ import annotations

from collections.abc import Callable

from hybrid_model.config import DSv4ModelConfig, YarnScaling


def tiny() -> DSv4ModelConfig:
    """Spec §9.4 tiny configuration."""
    return DSv4ModelConfig(
        name="tiny",
        vocab_size=512,
        hidden_size=64,
        num_layers=6,
        num_attention_heads=4,
        head_dim=32,
        qk_rope_head_dim=8,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        sliding_window=8,
        # spec §9.4 uses HCA ratio 8; dsv4-attention accepts only 0 / 4 / 128 (see README), so tiny uses 128
        compress_ratios=(0, 4, 128, 4, 128, 4, 0),
        csa_compress_ratio=4,
        hca_compress_ratio=128,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        yarn=YarnScaling(factor=4.0, original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0),
        max_position_embeddings=4096,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        hc_mult=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        num_hash_layers=2,
        routed_scaling_factor=1.5,
        swiglu_limit=10.0,
        num_nextn_predict_layers=1,
    )


def v4_flash() -> DSv4ModelConfig:
    """DeepSeek-V4-Flash (43 layers, d=4096, 256 experts)."""
    return DSv4ModelConfig(name="v4-flash")


def v4_pro() -> DSv4ModelConfig:
    """DeepSeek-V4-Pro (61 layers, d=7168, 384 experts)."""
    return DSv4ModelConfig(
        name="v4-pro",
        hidden_size=7168,
        num_layers=61,
        num_attention_heads=128,
        q_lora_rank=1536,
        o_groups=16,
        index_topk=1024,
        compress_ratios=(128, 128) + (4, 128) * 29 + (4, 0),
        n_routed_experts=384,
        moe_intermediate_size=3072,
        routed_scaling_factor=2.5,
    )


def flash_smoke() -> DSv4ModelConfig:
    """Single-GPU smoke model with real Flash per-layer shapes (spec §9.4, last paragraph)."""
    return DSv4ModelConfig(
        name="flash-smoke",
        num_layers=4,
        compress_ratios=(0, 4, 128, 4, 0),
        n_routed_experts=16,
        num_experts_per_tok=6,
        num_hash_layers=1,
    )


PRESETS: dict[str, Callable[[], DSv4ModelConfig]] = {
    "tiny": tiny,
    "v4-flash": v4_flash,
    "v4-pro": v4_pro,
    "flash-smoke": flash_smoke,
}


def get_preset(name: str) -> DSv4ModelConfig:
    """The preset called ``name`` (``ValueError`` listing the valid names otherwise)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
