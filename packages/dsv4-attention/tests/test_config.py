"""DSv4AttentionConfig: derived fields, per-layer helpers and the rejection of invalid settings."""

from __future__ import annotations

import pytest
import torch
from _attention_testconfig import tiny_config

from dsv4_attention import IndexerLossAutoScaler, LayerKind, check_compress_ratio
from dsv4_attention.megatron import DSv4AttentionConfig

FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4] + [0]


def test_defaults_are_v4_flash_attention_shapes():
    cfg = DSv4AttentionConfig(num_layers=43, hidden_size=4096, num_attention_heads=64, mtp_num_layers=1)
    assert (cfg.v_head_dim, cfg.qk_pos_emb_head_dim, cfg.q_lora_rank) == (512, 64, 1024)
    assert (cfg.qk_head_dim, cfg.kv_lora_rank) == (448, 448)  # derived: c - r
    assert (cfg.output_projection_groups, cfg.output_projection_lora_rank) == (8, 1024)
    assert (cfg.o_groups, cfg.o_lora_rank) == (8, 1024)  # dev/oracle aliases
    assert (cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim, cfg.dsa_indexer_topk) == (64, 128, 512)
    assert cfg.csa_window_size == 128 and cfg.csa_compress_rotary_base == 160000.0
    assert cfg.layernorm_epsilon == 1e-6 and not cfg.add_bias_linear
    assert cfg.experimental_attention_variant == "dsv4_hybrid"
    assert cfg.experimental_attention_variant_loss_scale_func == IndexerLossAutoScaler.set_loss_scale


def test_per_layer_ratio_lookup_and_mtp():
    cfg = tiny_config(num_layers=43, mtp_num_layers=1, csa_compress_ratios=FLASH_RATIOS)
    assert [cfg.compress_ratio_for_layer(n) for n in (1, 2, 3, 4, 43)] == [0, 0, 4, 128, 4]
    assert cfg.compress_ratio_for_layer(1, is_mtp_layer=True) == 0
    assert cfg.tracker_num_layers == 44
    assert cfg.num_indexer_layers == 21
    with pytest.raises(ValueError, match="outside"):
        cfg.compress_ratio_for_layer(2, is_mtp_layer=True)
    with pytest.raises(ValueError, match="csa_compress_ratios is None"):
        tiny_config().compress_ratio_for_layer(1)


def test_rope_config_per_layer_kind():
    cfg = DSv4AttentionConfig(
        num_layers=2, hidden_size=256, num_attention_heads=8, output_projection_groups=2
    )
    plain = cfg.rope_config_for_ratio(0)
    assert plain.base == 10000.0 and plain.yarn is None and plain.rope_dim == 64
    for r in (4, 128):
        rc = cfg.rope_config_for_ratio(r)
        assert rc.base == 160000.0
        assert (rc.yarn.factor, rc.yarn.original_max_position_embeddings) == (16.0, 65536)
        assert (rc.yarn.beta_fast, rc.yarn.beta_slow) == (32.0, 1.0)
    from dsv4_primitives import rope_inv_freq

    ratio = (
        rope_inv_freq(cfg.rope_config_for_ratio(4))
        / rope_inv_freq(cfg.rope_config_for_ratio(4).__class__(rope_dim=64, base=160000.0))
    ).double()
    expect = torch.tensor(
        [1.0] * 16
        + [0.90625, 0.8125, 0.71875, 0.625, 0.53125, 0.4375, 0.34375, 0.25, 0.15625]
        + [0.0625] * 7,
        dtype=torch.float64,
    )
    torch.testing.assert_close(ratio, expect, rtol=1e-6, atol=1e-7)  # oracle R3, no mscale anywhere
    assert tiny_config(csa_compress_rope_type="rope").rope_config_for_ratio(128).yarn is None


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(csa_compress_ratios=[0, 4, 8, 4]), "invalid entries"),
        (dict(csa_compress_ratios=[0, 4]), "one ratio per layer"),
        (dict(output_projection_groups=3), "divisible by output_projection_groups"),
        (dict(tensor_model_parallel_size=2), "set sequence_parallel=True"),
        (dict(context_parallel_size=2, cp_comm_type="p2p"), "own static contiguous context parallelism"),
        (dict(context_parallel_size=2, dsa_indexer_tie_break="torch_topk"), "'lower_index' only"),
        (dict(csa_window_size=0), "csa_window_size"),
        (dict(dsa_indexer_topk=0), "dsa_indexer_topk"),
        (dict(dsa_indexer_head_dim=4), "dsa_indexer_head_dim"),
        (dict(qk_pos_emb_head_dim=7), "qk_pos_emb_head_dim"),
        (dict(dsa_indexer_loss_coeff=-1.0), "dsa_indexer_loss_coeff"),
        (dict(csa_kernel_backend="cuda"), "csa_kernel_backend"),
        (dict(output_projection_lora_rank=0), "output_projection_lora_rank"),
        (dict(attention_dropout=0.1), "attention_dropout"),
        (dict(apply_rope_fusion=True, rope_type="yarn"), "apply_rope_fusion"),
        (dict(q_lora_rank=None), "q_lora_rank"),
    ],
)
def test_invalid_configs_are_rejected(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**overrides)


def test_tensor_parallel_config_with_sequence_parallelism_is_accepted():
    """TP > 1 runs dsv4_attention.tp on the sequence-parallel rows (it used to be refused); each layer's shard."""
    cfg = tiny_config(tensor_model_parallel_size=2, sequence_parallel=True)
    att = cfg.attention_config(LayerKind.CSA, 2)
    assert (att.tp_size, att.local_heads, att.local_groups) == (
        2,
        cfg.num_attention_heads // 2,
        cfg.o_groups // 2,
    )
    assert cfg.core_attention_config(LayerKind.CSA, 2).num_heads == cfg.num_attention_heads // 2


def test_context_parallel_config_is_accepted():
    """CP > 1 runs dsv4_attention.cp (it used to be refused)."""
    assert tiny_config(context_parallel_size=2).context_parallel_size == 2


@pytest.mark.parametrize("ratio", [1, 2, 8, 64, -4, None])
def test_invalid_compress_ratio(ratio):
    with pytest.raises(ValueError, match="compress_ratio must be one of"):
        check_compress_ratio(ratio)


def test_parameter_totals_match_spec():
    """S2 / §9.3: all attention parameters of the main model are 5.09 B (Flash) and 19.47 B (Pro)."""
    from dsv4_attention import parameter_table

    flash = DSv4AttentionConfig(num_layers=43, hidden_size=4096, num_attention_heads=64)
    pro = DSv4AttentionConfig(
        num_layers=61,
        hidden_size=7168,
        num_attention_heads=128,
        q_lora_rank=1536,
        output_projection_groups=16,
    )
    tf, tp = parameter_table(flash), parameter_table(pro)
    flash_total = 2 * tf[0]["total"] + 21 * tf[4]["total"] + 20 * tf[128]["total"]
    pro_total = 30 * tp[4]["total"] + 31 * tp[128]["total"]
    assert round(flash_total / 1e9, 2) == 5.09
    assert round(pro_total / 1e9, 2) == 19.47
    assert tf[4]["indexer"] == 8192 * 1024 + 64 * 4096 + 2 * 256 * 4096 + 4 * 256 + 128
