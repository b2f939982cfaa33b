"""The full D4 symbol set: every megatron-core 0.19.2 hybrid symbol beside C/H/W, mHC-wrapped; MTP depth > 1;
the mHC switch; parameter and FLOP counts of free-form patterns."""

import importlib.util
import re

import pytest
import torch

from dsv4_testkit import assert_close_to_ref
from hybrid_model.flops import forward_flops, forward_flops_from_stats
from hybrid_model.mixers.registry import require_symbol_dependencies
from hybrid_model.params import analytic_param_counts, build_meta_model, count_model_params
from hybrid_model.presets import get_preset

UPSTREAM_FUNCTIONAL = "WEC-|H-C-/W-"  # upstream's hybrid DSv4 functional-test pattern (PP2)


def _tiny(pattern=None, **changes):
    cfg = get_preset("tiny")
    cfg = cfg.with_pattern(pattern) if pattern else cfg
    return cfg.replace(**changes) if changes else cfg


def _train_step(model, b=2, s=16, vocab=512):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    pos = torch.arange(s)[None].expand(b, s)
    model.train()
    loss = model(ids, pos, None, labels=torch.roll(ids, -1, 1))  # [b, s]
    loss.mean().backward()
    return loss


@pytest.mark.parametrize(
    "pattern, layer_types",
    [
        # W C E - in the main part, a dense MTP depth
        ("WEC-/W-", {"DSv4TransformerLayer", "TransformerLayer"}),
        # standard attention + dense MLP + MoE, two MTP depths of '*E'
        ("*-*E/*E/*E", {"TransformerLayer"}),
    ],
)
def test_symbols_build_and_train(megatron_cpu, pattern, layer_types, caplog):
    from hybrid_model.model import build_model
    from mhc.megatron import HyperConnectionLayer

    cfg = _tiny(pattern)
    with caplog.at_level("WARNING", logger="megatron"):
        model = build_model(cfg)
    # the specs are in megatron's current form: no "Rewrapping ModuleSpec" (or other) warning per layer
    assert [r.getMessage() for r in caplog.records if r.levelno >= 30] == []
    assert all(isinstance(layer, HyperConnectionLayer) for layer in model.decoder.layers)
    assert {type(layer.inner_layer).__name__ for layer in model.decoder.layers} == layer_types
    loss = _train_step(model)
    assert torch.isfinite(loss).all()
    depths = cfg.parsed_pattern.mtp_num_depths
    assert len(model.last_mtp_losses) == depths and all(torch.isfinite(x) for x in model.last_mtp_losses)
    assert len(model.mtp.depths()) == depths
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    # every layer (and every MTP depth) receives gradient
    for i, layer in enumerate(model.decoder.layers):
        assert any(p.grad.abs().sum() > 0 for p in layer.inner_layer.parameters()), i
    for depth in model.mtp.depths():
        assert depth.e_proj.weight.grad.abs().sum() > 0, depth.depth


def test_mtp_depths_chain_and_roll(megatron_cpu):
    """Depth k's hidden states come from depth k-1's streams and the ids rolled left k times: changing the token at
    position t + 2 changes depth 2 at position t but not depth 1 there (depth 1 sees ids up to t + 1)."""
    from hybrid_model.model import build_model

    model = build_model(_tiny("WECE/WE/WE"))
    model.eval()
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(12)[None]

    def depth_hidden(x):
        streams = {}
        handle = model.decoder.register_forward_hook(lambda m, a, out: streams.setdefault("s", out[1]))
        with torch.no_grad():
            model(x, pos, None)
            out = model.mtp_hidden(streams["s"], x, pos)
        handle.remove()
        return out

    h1, h2 = depth_hidden(ids)
    changed = ids.clone()
    changed[0, 7] = (changed[0, 7] + 1) % 512
    g1, g2 = depth_hidden(changed)
    t = 5  # depth 1 at t reads ids[t + 1] = ids[6]; depth 2 reads ids[t + 2] = ids[7]
    torch.testing.assert_close(g1[t], h1[t], rtol=1e-6, atol=1e-6)
    assert (g2[t] - h2[t]).abs().max() > 1e-3


def test_hash_routing_never_in_mtp_layers(megatron_cpu):
    from hash_moe.megatron import DSv4MoELayer
    from hybrid_model.model import build_model

    cfg = _tiny("WECE/WE/WE")
    model = build_model(cfg)
    assert [m.is_hash_layer for m in model.decoder.moe_layers()] == [True, True]
    mtp_moes = [moe for depth in model.mtp.depths() for moe in depth.moe_layers()]
    assert len(mtp_moes) == 2 and all(isinstance(m, DSv4MoELayer) and not m.is_hash_layer for m in mtp_moes)


def _builds_param_counts(cfg):
    model = build_meta_model(cfg)
    return analytic_param_counts(cfg), count_model_params(model, cfg)


@pytest.mark.parametrize(
    "pattern, mhc",
    [
        (UPSTREAM_FUNCTIONAL.replace("|", ""), True),
        ("*-*E/*E/*E", True),
        (None, False),  # tiny, mHC off
        ("*-*E/*E", False),
        ("WE+-HDC-/D-", True),  # the functional pattern with MLA and DSA mixed in (local modules here)
        ("W+D-E/+E", False),
    ],
)
def test_param_counts_match_the_built_model(megatron_cpu, pattern, mhc):
    cfg = _tiny(pattern, enable_mhc_connections=mhc)
    analytic, built = _builds_param_counts(cfg)
    assert (analytic.main, analytic.mtp, analytic.activated) == (built.main, built.mtp, built.activated)
    if not mhc:
        assert not any(k.endswith("mhc") for k in analytic.components)


def test_param_counts_of_the_new_symbols_by_hand():
    """``-`` = 3·d·f + d, ``*`` = 4·d² + d, each + one mHC; the difference of two patterns isolates them."""
    from hybrid_model.params import mhc_params

    base, dense, attn = _tiny("WE"), _tiny("WE-"), _tiny("*E*")
    d, f = base.hidden_size, base.moe_intermediate_size
    total = lambda c: analytic_param_counts(c).total
    assert total(dense) - total(base) == 3 * d * f + d + mhc_params(base)
    # '*E*' vs 'WE': one more layer of '*', and W's attention (+ its norm) replaced by '*'
    w_attention = analytic_param_counts(base).components["attention.projections"]
    w_attention += analytic_param_counts(base).components["attention.sinks"] + d
    assert total(attn) - total(base) == 2 * (4 * d * d + d) + mhc_params(base) - w_attention


def test_flops_of_the_upstream_functional_pattern_by_hand():
    """FLOPs of 'WEC-|H-C-/W-' = those of 'WECEHECE/WE' with each '-' instead of an 'E': per token, a dense layer
    costs 2·3·d·f, an MoE layer 2·d·E + (K + shared)·2·3·d·f (the attention terms are the same)."""
    cfg = _tiny(UPSTREAM_FUNCTIONAL.replace("|", ""))
    ref = get_preset("tiny").replace(compress_ratios=(0, 4, 128, 4, 0), num_layers=4)
    assert ref.layer_pattern == "WECEHECE/WE"
    lengths = [37, 64, 5]
    T = sum(lengths)
    d, f, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    moe = 2 * d * E + (cfg.num_experts_per_tok + cfg.n_shared_experts) * 2 * 3 * d * f
    dense = 2 * 3 * d * f
    got, want = forward_flops(cfg, lengths), forward_flops(ref, lengths)
    assert got.components["mlp"] == 3 * dense * T and got.components["mtp.mlp"] == dense * T
    assert got.components["moe"] == moe * T and "mtp.moe" not in got.components
    assert got.forward == pytest.approx(
        want.forward - 3 * moe * T + 3 * dense * T - moe * T + dense * T, rel=1e-12
    )


def test_flops_of_standard_attention_by_hand():
    """'*': QKV + output 2·4·d² per token, core 4·d per causal (query, key) pair; the THD closed form is exact."""
    cfg = _tiny("*-*E")
    lengths = [7, 30, 1]
    T, d = sum(lengths), cfg.hidden_size
    pairs = sum(L * (L + 1) // 2 for L in lengths)
    br = forward_flops(cfg, lengths)
    assert br.components["attention.projections"] == 2 * 8 * d * d * T
    assert br.components["attention.causal_core"] == 2 * 4 * d * pairs
    stats = forward_flops_from_stats(cfg, T, sum(L * L for L in lengths))
    assert stats.forward == pytest.approx(br.forward, rel=1e-12)


def test_standard_attention_needs_whole_heads():
    with pytest.raises(
        ValueError, match=r"hidden_size \(66\) must be divisible by num_attention_heads \(4\)"
    ):
        get_preset("tiny").replace(hidden_size=66).with_pattern("*E")


def test_flops_and_params_refuse_uncounted_symbols():
    cfg = _tiny("WME")  # Mamba: counted neither analytically (a built model is counted) nor in FLOPs
    with pytest.raises(ValueError, match=re.escape("'M' (megatron-core's mamba layer) is not counted")):
        forward_flops(cfg, [8])
    with pytest.raises(ValueError, match="count a built model"):
        analytic_param_counts(cfg)


@pytest.mark.parametrize(
    "symbol, missing, names",
    [
        ("M", "mamba_ssm", "mamba-ssm"),
        ("M", "causal_conv1d", "causal-conv1d"),
        ("M", "transformer_engine", "hybrid-model[gpu]"),
        ("G", "fla", "hybrid-model[gdn]"),
    ],
)
def test_symbols_with_missing_dependencies_raise_import_error(monkeypatch, symbol, missing, names):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a)
    )
    with pytest.raises(ImportError, match=re.escape(f"pattern symbol '{symbol}'") + ".*" + re.escape(names)):
        require_symbol_dependencies("WE" + symbol)


def test_mla_and_dsa_need_no_optional_package(monkeypatch):
    """'+' and 'D' build from megatron's local modules when transformer-engine is missing: nothing is required."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    require_symbol_dependencies("W+D-E")


@pytest.mark.skipif(importlib.util.find_spec("mamba_ssm") is not None, reason="mamba_ssm is installed here")
def test_building_a_mamba_pattern_without_mamba_ssm_fails_at_build_time(megatron_cpu):
    from hybrid_model.model import build_model

    cfg = _tiny("MEWE")  # the config is fine; the build needs the package
    with pytest.raises(ImportError, match="mamba-ssm"):
        build_model(cfg)


def test_mhc_off_builds_plain_residual_layers_and_trains(megatron_cpu):
    from hybrid_model.model import build_model
    from hybrid_model.residual import PlainResidualLayer, SingleStreamHead

    cfg = _tiny(None, enable_mhc_connections=False)
    model = build_model(cfg)
    assert all(isinstance(layer, PlainResidualLayer) for layer in model.decoder.layers)
    assert isinstance(model.decoder.hyper_head, SingleStreamHead)
    assert not [n for n, _ in model.named_parameters() if "hc" in n.split(".")[-2:][0] or "hyper_head" in n]
    loss = _train_step(model)
    assert torch.isfinite(loss).all() and torch.isfinite(model.last_mtp_loss)


def test_plain_residual_layer_is_x_plus_f(megatron_cpu):
    """A plain layer computes x + attn(x), then + mlp(·): compare with the inner layer's own (residual) forward."""
    from megatron.core.transformer.spec_utils import build_module

    from hybrid_model.mixers.mlp import mlp_layer_spec
    from hybrid_model.residual import PlainResidualLayer
    from hybrid_model.spec import select_backend, transformer_config

    cfg = _tiny("*-")
    tc = transformer_config(cfg)
    torch.manual_seed(0)
    inner = build_module(mlp_layer_spec(select_backend("local")), config=tc, layer_number=1)
    x = torch.randn(5, 2, cfg.hidden_size)
    want, _ = inner(x, None)  # megatron's TransformerLayer: x + mlp(norm(x))
    got, _ = PlainResidualLayer(tc, inner)(x)
    assert_close_to_ref("plain residual", got, want)
