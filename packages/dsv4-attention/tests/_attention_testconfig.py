"""The tiny DSv4 attention config of the tests (spec §9.4), importable from every test module.

A uniquely named module (not ``conftest``) so that several packages' tests can run in one pytest process.
"""

from __future__ import annotations

TINY = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    q_lora_rank=32,
    v_head_dim=32,
    qk_pos_emb_head_dim=8,
    output_projection_groups=2,
    output_projection_lora_rank=16,
    csa_window_size=8,
    dsa_indexer_n_heads=2,
    dsa_indexer_head_dim=16,
    dsa_indexer_topk=4,
    rotary_scaling_factor=4.0,
    original_max_position_embeddings=32,
    use_cpu_initialization=True,
)


def tiny_config(**overrides):
    from dsv4_attention.megatron import DSv4AttentionConfig

    return DSv4AttentionConfig(**{**TINY, **overrides})
