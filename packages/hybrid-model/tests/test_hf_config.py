"""HF interop without transformers models: config.json spellings <-> DSv4ModelConfig (spec §9.1), tensor-name
spellings (§9.2, §11 item 19), sharded safetensors I/O, and clear errors for what we cannot run."""

import dataclasses

import pytest
import torch

from hybrid_model.hf import canonical_name, hf_config_from_model_config, hf_saved_name, model_config_from_hf
from hybrid_model.presets import get_preset

FLASH_RELEASED = {  # the released V4-Flash config.json keys (spec §9.1)
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "compress_rope_theta": 160000,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "num_hash_layers": 3,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "topk_method": "noaux_tc",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

FLASH_MODEL_ARGS = {  # official inference ModelArgs names (inference/config.json)
    "vocab_size": 129280,
    "dim": 4096,
    "n_layers": 43,
    "n_heads": 64,
    "q_lora_rank": 1024,
    "head_dim": 512,
    "rope_head_dim": 64,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "window_size": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "compress_rope_theta": 160000.0,
    "rope_theta": 10000.0,
    "original_seq_len": 65536,
    "rope_factor": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "n_activated_experts": 6,
    "moe_inter_dim": 2048,
    "n_hash_layers": 3,
    "n_mtp_layers": 1,
    "score_func": "sqrtsoftplus",
    "route_scale": 1.5,
    "swiglu_limit": 10.0,
    "norm_eps": 1e-6,
}


def _same(a, b) -> None:
    assert dataclasses.replace(a, name="x") == dataclasses.replace(b, name="x")


@pytest.mark.parametrize("spelling", [FLASH_RELEASED, FLASH_MODEL_ARGS], ids=["released", "model_args"])
def test_released_flash_config_is_the_v4_flash_preset(spelling):
    _same(model_config_from_hf(spelling), get_preset("v4-flash"))
    no_mtp = model_config_from_hf(spelling, with_mtp=False)
    assert no_mtp.num_nextn_predict_layers == 0 and len(no_mtp.compress_ratios) == 43


@pytest.mark.parametrize("name", ["tiny", "v4-flash", "v4-pro", "flash-smoke"])
def test_transformers_config_round_trip(name):
    cfg = get_preset(name)
    hf = hf_config_from_model_config(cfg)
    _same(model_config_from_hf(hf), cfg)
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    assert hf["layer_types"] == [kinds[r] for r in cfg.compress_ratios[: cfg.num_layers]]


@pytest.mark.parametrize("name", ["tiny", "v4-pro"])
def test_transformers_reads_our_config_the_same_way(name):
    import transformers

    cfg = get_preset(name)
    hc = transformers.DeepseekV4Config(**hf_config_from_model_config(cfg))
    assert hc.qk_rope_head_dim == cfg.qk_rope_head_dim
    assert hc.mlp_layer_types.count("hash_moe") == cfg.num_hash_layers
    comp = hc.rope_parameters["compress"]
    assert comp["rope_type"] == "yarn" and comp["factor"] == cfg.yarn.factor
    # and what transformers writes back parses to the same model config
    _same(model_config_from_hf(hc.to_dict()), cfg)


def _tiny_hf() -> dict:
    return hf_config_from_model_config(get_preset("tiny"))


def _set(path: str, value):
    def edit(c: dict) -> None:
        *parents, last = path.split(".")
        for p in parents:
            c = c[p]
        if value is KeyError:
            c.pop(last)
        else:
            c[last] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_set("compress_rates", {"compressed_sparse_attention": 8}), "only CSA ratio 4 and HCA ratio 128"),
        (_set("quantization_config", {"quant_method": "awq"}), "only the released"),
        (_set("num_key_value_heads", 2), "num_key_value_heads"),
        (_set("mlp_layer_types", ["moe", "hash_moe", "moe", "moe", "moe", "moe"]), "first MoE layers"),
        (_set("rope_parameters.compress.attention_factor", 1.277), "mscale"),
        (_set("rope_parameters.main.rope_type", "yarn"), "plain RoPE"),
        (_set("rope_parameters.compress.rope_type", "longrope"), "rope_type"),
        (_set("tie_word_embeddings", True), "untied"),
        (_set("scoring_func", "sigmoid"), "scoring_func"),
        (_set("layer_types", KeyError), "layer schedule"),
        (_set("model_type", "deepseek_v3"), "model_type"),
        (_set("n_group", 8), "group-limited"),
        (_set("hidden_act", "gelu"), "silu"),
        (_set("sliding_window", None), "sliding_window"),
        (_set("layer_types", ["sliding_attention"] * 3), "schedule has 3 entries"),
    ],
)
def test_unsupported_configs_raise(edit, match):
    c = _tiny_hf()
    edit(c)
    with pytest.raises(ValueError, match=match):
        model_config_from_hf(c)


def test_compress_ratio_lists_are_validated():
    c = dict(FLASH_RELEASED, compress_ratios=[0, 8] + [4, 128] * 20 + [4, 0])
    with pytest.raises(ValueError, match=r"holds \[8\]"):
        model_config_from_hf(c)
    c = dict(FLASH_RELEASED, compress_ratios=[0, 0] + [4, 128] * 20 + [4, 4])
    with pytest.raises(ValueError, match="MTP layers must be window-only"):
        model_config_from_hf(c)


@pytest.mark.parametrize(
    ("name", "official"),
    [
        ("model.embed_tokens.weight", "embed.weight"),
        ("lm_head.weight", "head.weight"),
        ("head.weight", "head.weight"),
        ("model.hc_head.hc_fn", "hc_head_fn"),
        ("model.layers.3.attn.norm.weight", "layers.3.attn.kv_norm.weight"),
        ("model.layers.3.self_attn.kv_norm.weight", "layers.3.attn.kv_norm.weight"),
        ("model.layers.3.self_attn.compressor.kv_norm.weight", "layers.3.attn.compressor.norm.weight"),
        (
            "model.layers.3.self_attn.compressor.indexer.kv_norm.weight",
            "layers.3.attn.indexer.compressor.norm.weight",
        ),
        (
            "model.layers.3.self_attn.compressor.indexer.scorer.weights_proj.weight",
            "layers.3.attn.indexer.weights_proj.weight",
        ),
        ("model.layers.1.mlp.gate.e_score_correction_bias", "layers.1.ffn.gate.bias"),
        ("model.layers.1.ffn.experts.7.w3.weight", "layers.1.ffn.experts.7.w3.weight"),
        ("model.layers.1.mlp.experts.gate_up_proj", "layers.1.ffn.experts.gate_up_proj"),
        ("model.layers.1.attn_hc.fn", "layers.1.hc_attn_fn"),
        ("mtp.0.hc_head_base", "mtp.0.hc_head_base"),
        ("mtp.0.attn.wkv.weight", "mtp.0.attn.wkv.weight"),
        ("layers.0.e_proj.weight", None),  # MTP-only tensor outside mtp.*
        ("model.rotary_emb.main_inv_freq", None),
        ("layers.0.attn.wq_a.scale", None),  # FP8 scale
    ],
)
def test_canonical_names(name, official):
    assert canonical_name(name) == official


def test_every_model_tensor_has_official_and_saved_names(megatron_cpu):
    from hybrid_model.hf import official_state_dict
    from hybrid_model.model import build_model

    cfg = get_preset("tiny")
    sd = official_state_dict(build_model(cfg))
    blocks = {k.split(".")[1] for k in sd if k.startswith("layers.")}
    assert blocks == {str(i) for i in range(cfg.num_layers)}
    assert any(k.startswith("mtp.0.ffn.experts.") for k in sd)
    assert sd["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert "layers.2.ffn.gate.bias" in sd and "layers.2.ffn.gate.tid2eid" not in sd  # learned layer
    saved = {hf_saved_name(k) for k in sd}
    assert len(saved) == len(sd)
    assert {"model.embed_tokens.weight", "head.weight", "model.layers.0.attn.norm.weight"} <= saved
    for k in sd:
        assert canonical_name(k) == k and canonical_name(hf_saved_name(k)) == k


def test_sharded_write_and_read(tmp_path):
    from hybrid_model.hf.io import INDEX, read_config, read_tensors, write_checkpoint

    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(64, 16, generator=g) for i in range(5)}
    files = write_checkpoint(tmp_path / "ck", tensors, {"model_type": "deepseek_v4"}, max_shard_bytes=8192)
    assert len(files) == 3 and (tmp_path / "ck" / INDEX).is_file()
    back = read_tensors(tmp_path / "ck")
    assert sorted(back) == sorted(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
    with pytest.raises(ValueError, match="already holds"):
        write_checkpoint(tmp_path / "ck", tensors, {})
    (tmp_path / "no_config").mkdir()
    with pytest.raises(ValueError, match=r"config\.json"):
        read_config(tmp_path / "no_config")
    with pytest.raises(ValueError, match="not a directory"):
        read_tensors(tmp_path / "nowhere")
