"""HF interop (spec §9.2, §10 P1): a tiny random transformers ``DeepseekV4ForCausalLM`` saved with
``save_pretrained``, loaded by ``hybrid_model.hf.load_hf_checkpoint``, gives the same fp32 logits; the conversions
HF -> megatron -> HF (``dsv4 convert``, tested as a command in dsv4-train) reproduce every tensor exactly; other spellings, MTP tensors and bad checkpoints."""

import json
import shutil

import pytest
import torch
import transformers

V, T_LONG = 64, 300  # T > window (8), > CSA ratio * top-k (16) and > 2 HCA blocks (256)
LAYER_TYPES = [
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
]


def _hf_config(variant: str):
    """Tiny HF config: W C H C, hash + learned MoE, mHC n=4; ``yarn`` also clamps SwiGLU hard and splits eps."""
    yarn = variant == "yarn"
    rope = None
    if yarn:
        rope = {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32,
            "beta_slow": 1,
        }
    return transformers.DeepseekV4Config(
        vocab_size=V,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=16,
        q_lora_rank=16,
        partial_rotary_factor=0.5,  # r = 8
        layer_types=LAYER_TYPES,
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        n_routed_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=2,  # tie-prone: needs the CPU torch.topk tie rule (spec §4.2 rule 1)
        index_head_dim=16,
        index_topk=4,
        rope_parameters=rope,
        max_position_embeddings=4096,
        swiglu_limit=0.5 if yarn else 10.0,
        rms_norm_eps=1e-3 if yarn else 1e-6,
        hc_eps=1e-2 if yarn else 1e-6,
        routed_scaling_factor=1.5,
    )


def _randomize(model, seed: int) -> None:
    """Noise on every parameter (HF init leaves sinks/ape/biases at 0), large sinks and ape, random bias and
    distinct-expert hash tables (HF initialises tid2eid to a zero placeholder)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            big = name.endswith(("sinks", "position_bias"))
            p.add_(torch.randn(p.shape, generator=g) * (1.0 if big else 0.15))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                e = model.config.n_routed_experts
                rows = [torch.randperm(e, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]
                b.copy_(torch.stack(rows))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.5)


@pytest.fixture(scope="module", params=["rope", "yarn"])
def hf_tiny(request, tmp_path_factory):
    """``(directory, HF model, input ids [2, 300], HF logits)``."""
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(_hf_config(request.param)).eval()
    _randomize(model, seed=1 + (request.param == "yarn"))
    path = tmp_path_factory.mktemp(f"hf_{request.param}")
    model.save_pretrained(path)
    ids = torch.randint(0, V, (2, T_LONG), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids).logits
    return path, model, ids, ref


def _rel_err(out, ref) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


def _logits(model, ids):
    from hybrid_model.hf import hf_cpu_topk_ties

    with hf_cpu_topk_ties(model):
        return model.compute_logits(ids)


def test_logits_match_transformers(megatron_cpu, hf_tiny):
    from hybrid_model.hf import load_hf_checkpoint

    path, _, ids, ref = hf_tiny
    model = load_hf_checkpoint(path)
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    attn = [layer.inner_layer.self_attention for layer in model.decoder.layers[::2]]
    assert [a.compress_ratio for a in attn] == [0, 4, 128, 4]
    assert [m.is_hash_layer for m in model.decoder.moe_layers()] == [True, True, False, False]
    assert not hasattr(model, "mtp")  # save_pretrained writes no MTP weights
    out = _logits(model, ids)
    assert out.shape == ref.shape == (2, T_LONG, V)
    assert _rel_err(out, ref) < 1e-5  # spec P1: ~5e-7 (fp64) .. 5e-6 (perturbed models) relative


@pytest.mark.parametrize("t", [1, 3, 127, 128, 129])
def test_short_and_boundary_lengths_match(megatron_cpu, hf_tiny, t):
    """T < m, T = m' - 1, m', m' + 1 (spec P1)."""
    from hybrid_model.hf import load_hf_checkpoint

    path, hf_model, ids, _ = hf_tiny
    ids = ids[:, :t]
    with torch.no_grad():
        ref = hf_model(ids).logits
    assert _rel_err(_logits(load_hf_checkpoint(path), ids), ref) < 1e-5


def _safetensors(path):
    from hybrid_model.hf.io import read_tensors

    return read_tensors(path)


def test_convert_round_trip_is_exact(megatron_cpu, hf_tiny, tmp_path):
    from hybrid_model.hf import (
        convert_hf_to_megatron,
        convert_megatron_to_hf,
        load_hf_checkpoint,
        load_megatron_checkpoint,
    )

    path, hf_model, ids, _ = hf_tiny
    mg, back = tmp_path / "megatron", tmp_path / "hf"
    convert_hf_to_megatron(path, mg)
    assert (mg / "metadata.json").is_file() and (mg / "dsv4_model_config.json").is_file()
    convert_megatron_to_hf(mg, back)
    a, b = _safetensors(path), _safetensors(back)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k
    # the megatron checkpoint holds the same model
    direct, restored = load_hf_checkpoint(path), load_megatron_checkpoint(mg)
    assert torch.equal(direct.compute_logits(ids[:, :40]), restored.compute_logits(ids[:, :40]))
    # transformers loads the exported directory completely and computes the same logits
    hf_back, info = transformers.DeepseekV4ForCausalLM.from_pretrained(back, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"))
    with torch.no_grad():
        assert torch.equal(hf_back.eval()(ids[:, :40]).logits, hf_model(ids[:, :40]).logits)
    src_cfg, back_cfg = (json.loads((p / "config.json").read_text()) for p in (path, back))
    assert {k: v for k, v in src_cfg.items() if k != "transformers_version"} == back_cfg


def _mtp_tensors(path, seed: int) -> dict:
    """Random official ``mtp.0.*`` tensors with the shapes of this config's MTP depth."""
    from hybrid_model.hf import model_config_from_hf, official_state_dict
    from hybrid_model.hf.io import read_config
    from hybrid_model.hf.loader import build_empty_model

    model = build_empty_model(model_config_from_hf(read_config(path), with_mtp=True))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in official_state_dict(model).items():
        if k.startswith("mtp."):
            out[k] = torch.randn(v.shape, generator=g) if v.is_floating_point() else v
    return out


def test_mtp_tensors_load_and_survive_round_trip(megatron_cpu, hf_tiny, tmp_path):
    from safetensors.torch import save_file

    from hybrid_model.hf import (
        convert_hf_to_megatron,
        convert_megatron_to_hf,
        load_hf_checkpoint,
        official_state_dict,
    )

    path = hf_tiny[0]
    src = tmp_path / "with_mtp"
    shutil.copytree(path, src)
    mtp = _mtp_tensors(path, seed=5)
    assert {k.split(".")[2] for k in mtp} >= {"e_proj", "h_proj", "attn", "ffn", "hc_head_fn"}
    save_file(mtp, str(src / "mtp.safetensors"))
    model = load_hf_checkpoint(src)
    assert model.mtp_process and model.model_config.num_nextn_predict_layers == 1
    got = official_state_dict(model)
    for k, v in mtp.items():
        assert torch.equal(got[k], v), k
    ids = hf_tiny[2][:, :40]
    model.train()
    assert torch.isfinite(model(ids, None, None, labels=torch.roll(ids, -1, 1))).all()
    assert torch.isfinite(model.last_mtp_loss)
    with pytest.raises(ValueError, match="mtp=True"):
        load_hf_checkpoint(path, mtp=True)
    assert not hasattr(load_hf_checkpoint(src, mtp=False), "mtp")
    mg, back = tmp_path / "megatron", tmp_path / "back"
    convert_hf_to_megatron(src, mg)
    convert_megatron_to_hf(mg, back)
    a, b = _safetensors(src), _safetensors(back)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    # transformers ignores mtp.* and still loads everything else
    _, info = transformers.DeepseekV4ForCausalLM.from_pretrained(back, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]


def test_our_checkpoint_exports_to_transformers_with_equal_logits(megatron_cpu, tmp_path):
    """Export direction: a ``dsv4 train``-style checkpoint of the ``tiny`` preset (randomly initialised by us, MTP
    included) -> ``convert_megatron_to_hf`` with the preset's config (``dsv4 convert --preset tiny``) -> transformers computes our logits."""
    from hybrid_model.hf.convert import MODEL_CONFIG_FILE, convert_megatron_to_hf, save_megatron_checkpoint
    from hybrid_model.model import build_model
    from hybrid_model.presets import get_preset

    torch.manual_seed(4)
    model = build_model(get_preset("tiny")).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ck = tmp_path / "run" / "checkpoints" / "iter_0000003"
    save_megatron_checkpoint(model, ck)
    (ck / MODEL_CONFIG_FILE).unlink()  # as dsv4 train writes it: the model config comes from --preset
    (ck.parent / "latest").write_text(ck.name)
    convert_megatron_to_hf(tmp_path / "run", tmp_path / "hf", model_config=get_preset("tiny"))
    hf_model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        tmp_path / "hf", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"]
    ids = torch.randint(0, 512, (2, 140), generator=torch.Generator().manual_seed(4))  # one HCA entry
    with torch.no_grad():
        ref = hf_model.eval()(ids).logits
    assert _rel_err(_logits(model, ids), ref) < 1e-5


def _official_name(hf_name: str) -> str:
    from hybrid_model.hf import canonical_name

    return canonical_name(hf_name)


def test_official_and_module_spellings_load_the_same_model(megatron_cpu, hf_tiny, tmp_path):
    from safetensors.torch import save_file

    from hybrid_model.hf import load_hf_checkpoint, official_state_dict

    path, hf_model = hf_tiny[:2]
    expected = official_state_dict(load_hf_checkpoint(path))
    saved = _safetensors(path)
    official = {_official_name(k): v for k, v in saved.items()}
    assert "layers.0.attn.kv_norm.weight" in official and "embed.weight" in official
    module_names = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in module_names  # fused [E, 2F, d]
    for name, tensors in (("official", official), ("module", module_names)):
        d = tmp_path / name
        d.mkdir()
        shutil.copy(path / "config.json", d / "config.json")
        save_file(tensors, str(d / "model.safetensors"))
        got = official_state_dict(load_hf_checkpoint(d))
        assert sorted(got) == sorted(expected)
        assert all(torch.equal(got[k], expected[k]) for k in got), name


def _broken_copy(path, tmp_path, edit):
    from safetensors.torch import save_file

    d = tmp_path / "broken"
    d.mkdir()
    shutil.copy(path / "config.json", d / "config.json")
    tensors = _safetensors(path)
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda t: t.pop("model.layers.1.attn.compressor.ape"), "lacks 1 tensor"),
        (lambda t: t.update({"model.layers.0.attn.wq_a.scale": torch.ones(1)}), "dequantize"),
        (
            lambda t: t.update({"model.layers.0.ffn.gate.tid2eid": torch.zeros(V, 2, dtype=torch.long)}),
            "repeats",
        ),
        (lambda t: t.update({"model.norm.weight": torch.ones(33)}), "shape"),
        (lambda t: t.update({"model.layers.0.attn.compressor.ape": torch.ones(4, 32)}), "no place"),
        (
            lambda t: t.update(
                {
                    "model.layers.0.attn.wq_a.weight": t["model.layers.0.attn.wq_a.weight"].to(
                        torch.float8_e4m3fn
                    )
                }
            ),
            "quantized",
        ),
    ],
    ids=["missing", "scale-tensor", "zero-hash-table", "shape", "extra", "fp8"],
)
def test_bad_checkpoints_raise(megatron_cpu, hf_tiny, tmp_path, edit, match):
    from hybrid_model.hf import load_hf_checkpoint

    path = hf_tiny[0]
    with pytest.raises(ValueError, match=match):
        load_hf_checkpoint(_broken_copy(path, tmp_path, edit))
