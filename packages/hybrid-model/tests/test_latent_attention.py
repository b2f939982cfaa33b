"""``+`` (MLA) and ``D`` (DSA) without transformer-engine: megatron's MLA / DSA modules built from local parts
(``hybrid_model.latent_attention``), chosen automatically without TE; causal, packed-THD aware, mHC wrapped, exact
parameter counts, trained from the CLI and under ``--pp 2`` (fp32, equal to PP = 1)."""

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from hybrid_model.flops import forward_flops, forward_flops_from_stats
from hybrid_model.mixers.dsa import dsa_core_per_pair
from hybrid_model.mixers.registry import REGISTRY
from hybrid_model.presets import get_preset

FUNCTIONAL = "WE+-|HDC-/D-"  # upstream's functional pattern 'WEC-|H-C-/W-' with MLA and DSA mixed in


def _tiny(pattern):
    return get_preset("tiny").with_pattern(pattern)


def _te_installed(monkeypatch, installed: bool) -> None:
    real = importlib.util.find_spec
    te = object() if installed else None
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: te if n == "transformer_engine" else real(n, *a)
    )


def test_local_specs_are_chosen_without_transformer_engine(monkeypatch):
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    cfg = _tiny("W+DE")
    _te_installed(monkeypatch, False)
    for symbol in "+D":
        assert REGISTRY[symbol].spec(cfg, None, False).params == {"record": REGISTRY[symbol], "local": True}
    _te_installed(monkeypatch, True)
    # transformer-engine importable: megatron's own TE spec, built with the same per-layer config
    te = REGISTRY["+"].spec(cfg, None, False)
    assert te.params == {"record": REGISTRY["+"], "local": False}
    assert te.submodules is hybrid_stack_spec.submodules.mla_layer.submodules
    assert (
        REGISTRY["D"].spec(cfg, None, False).submodules is hybrid_stack_spec.submodules.dsa_layer.submodules
    )
    # selectable: an explicit local backend (what select_backend gives without TE or CUDA) picks the local spec
    assert REGISTRY["D"].spec(cfg, LocalSpecProvider(), False).params["local"] is True


def test_layer_config_and_refusals(megatron_cpu):
    from hybrid_model.latent_attention import latent_layer_config
    from hybrid_model.spec import transformer_config

    tc = transformer_config(_tiny("W+DE"))
    mla, dsa = latent_layer_config(tc, "+", local=True), latent_layer_config(tc, "D", local=True)
    assert mla.qk_layernorm and dsa.qk_layernorm and not tc.qk_layernorm  # the model config is not changed
    assert (mla.transformer_impl, dsa.transformer_impl) == ("local", "local")
    assert dsa.experimental_attention_variant == "dsa" and mla.experimental_attention_variant == "dsv4_hybrid"
    assert not dsa.dsa_indexer_rotate_activation  # fp32 (the Hadamard rotation needs bf16 + its package)
    assert latent_layer_config(tc, "+", local=False).transformer_impl == tc.transformer_impl
    with pytest.raises(ValueError, match="'\\+' and 'D'"):
        latent_layer_config(tc, "W", local=True)
    cp2 = types.SimpleNamespace(cp=types.SimpleNamespace(size=lambda: 2))
    with pytest.raises(
        ValueError, match="pattern symbol 'D' without transformer-engine does not support context"
    ):
        REGISTRY["D"].check_single_rank(tc, cp2)


def test_functional_pattern_builds_and_trains(megatron_cpu):
    """Every layer mHC-wrapped; '+' = MLASelfAttention over the causal softmax core, 'D' = absorbed MLA +
    megatron's DSAttention with a duplicated-linear indexer; every parameter (the indexer's from its KL loss) gets
    a finite, non-zero gradient, and the DSA indexer losses reach the per-layer tracker."""
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from hybrid_model.latent_attention import DuplicatedLinear, drain_dsa_indexer_losses
    from hybrid_model.model import build_model
    from hybrid_model.standard_attention import CausalSoftmaxAttention
    from mhc.megatron import HyperConnectionLayer

    cfg = _tiny(FUNCTIONAL.replace("|", ""))
    torch.manual_seed(0)
    model = build_model(cfg)
    layers = list(model.decoder.layers) + list(model.mtp.depths()[0].block)
    assert all(isinstance(x, HyperConnectionLayer) for x in layers)
    attn = {i: x.inner_layer.self_attention for i, x in enumerate(model.decoder.layers) if i in (2, 5)}
    assert isinstance(attn[2], MLASelfAttention) and isinstance(
        attn[2].core_attention, CausalSoftmaxAttention
    )
    assert isinstance(attn[5], AbsorbedMLASelfAttention) and isinstance(attn[5].core_attention, DSAttention)
    assert isinstance(attn[5].core_attention.indexer.linear_wk, DuplicatedLinear)
    assert isinstance(attn[2].q_layernorm, torch.nn.RMSNorm) and isinstance(
        attn[5].kv_layernorm, torch.nn.RMSNorm
    )
    drain_dsa_indexer_losses()
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    model.train()
    loss = model(ids, torch.arange(24)[None].expand(2, 24), None, labels=torch.roll(ids, -1, 1))
    loss.mean().backward()
    assert torch.isfinite(loss).all()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    for i, layer in enumerate(layers):
        assert any(p.grad.abs().sum() > 0 for p in layer.inner_layer.parameters()), i
    assert attn[5].core_attention.indexer.linear_wq_b.weight.grad.abs().sum() > 0  # KL loss -> indexer
    tracked = drain_dsa_indexer_losses()
    # megatron's slots are layer numbers: the main D is layer 6; the MTP depth's D is layer 1 of its depth
    assert tracked is not None and tracked[5] > 0 and tracked[0] > 0 and torch.count_nonzero(tracked) == 2


def test_local_norms_are_built_in_params_dtype(megatron_cpu):
    """The local specs' norms (input, q/kv latent, DSA indexer k-norm) take ``params_dtype`` as TE's ``TENorm``
    does, so a bf16 model built without ``Float16Module`` runs; megatron's ``WrappedTorchNorm`` alone left the
    indexer's LayerNorm fp32, which CUDA refused ("expected scalar type BFloat16 but found Float" on the H200)."""
    from hybrid_model.latent_attention import TypedTorchNorm
    from hybrid_model.model import build_model

    model = build_model(_tiny("W+DE/WE"), params_dtype=torch.bfloat16, bf16=True)
    norms = {}
    for i in (1, 2):
        for name, mod in model.decoder.layers[i].inner_layer.named_modules():
            if isinstance(mod, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
                norms[f"{i}.{name}"] = {p.dtype for p in mod.parameters()}
    assert len(norms) == 3 + 4, norms  # '+': input, q, kv; 'D': input, q, kv, indexer k
    assert all(d == {torch.bfloat16} for d in norms.values()), norms
    assert all(
        p.dtype == torch.bfloat16 for i in (1, 2) for p in model.decoder.layers[i].inner_layer.parameters()
    )

    class Cfg:  # the normalization and dtype fields TypedTorchNorm reads
        normalization, params_dtype = "LayerNorm", torch.float16
        layernorm_zero_centered_gamma = persist_layer_norm = sequence_parallel = False
        memory_efficient_layer_norm = False

    ln = TypedTorchNorm(Cfg(), 16, eps=1e-6)
    assert isinstance(ln, torch.nn.LayerNorm) and ln.weight.dtype == ln.bias.dtype == torch.float16
    assert ln.eps == 1e-6


@pytest.mark.parametrize("symbol", ["+", "D"])
def test_layer_is_causal_and_packed_equals_each_document(megatron_cpu, symbol):
    """One '+' / 'D' layer: rows before t do not change when later rows do (SBHD), and a packed THD pack of two
    documents gives each document's rows of its own SBHD forward (RoPE and attention restart per document; DSA's
    top-k (k = 4 < the document lengths) picks among the document's own earlier keys)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.spec_utils import build_module

    from hybrid_model.latent_attention import local_latent_layer_spec
    from hybrid_model.spec import transformer_config

    cfg = _tiny(f"W{symbol}E")
    tc = transformer_config(cfg)
    torch.manual_seed(0)
    layer = build_module(local_latent_layer_spec(REGISTRY[symbol]), config=tc, layer_number=2).eval()
    x = torch.randn(15, 1, cfg.hidden_size)
    with torch.no_grad():
        out, _ = layer(x, None)
        later = x.clone()
        later[9:] += 1.0
        out2, _ = layer(later, None)
        torch.testing.assert_close(out2[:9], out[:9], rtol=0, atol=0)
        assert not torch.allclose(out2[9:], out[9:])
        cu = torch.tensor([0, 6, 15], dtype=torch.int32)
        psp = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9
        )
        packed, _ = layer(x, None, packed_seq_params=psp)
        for a, e in [(0, 6), (6, 15)]:
            alone, _ = layer(x[a:e], None)
            torch.testing.assert_close(packed[a:e], alone, rtol=1e-5, atol=1e-5)


def test_hf_export_refuses_mla_and_dsa():
    from hybrid_model.hf.config_map import check_hf_representable

    for pattern in ("W+D-E", "WE+E/WE", "WEDE/WE"):
        with pytest.raises(
            ValueError, match="Hugging Face DeepSeek-V4 holds only blocks of one C/H/W attention"
        ):
            check_hf_representable(_tiny(pattern))


def test_flops_closed_forms():
    """'+': the THD closed form is exact (causal pairs); 'D': it charges k selected keys per token, an upper bound
    above the exact count by Σ over each document's queries of k - min(t+1, k)."""
    lengths = [7, 30, 1]
    stats = (sum(lengths), sum(x * x for x in lengths))
    mla = _tiny("+-E")  # no W: its window term is an upper bound in the closed form
    assert forward_flops_from_stats(mla, *stats).forward == pytest.approx(forward_flops(mla, lengths).forward)
    dsa = _tiny("WDE")
    k = dsa.index_topk
    exact, bound = forward_flops(dsa, lengths), forward_flops_from_stats(dsa, *stats)
    short = sum(
        k * (k - 1) // 2 if x >= k else k * x - x * (x + 1) // 2 for x in lengths
    )  # Σ (k - min(t+1, k))
    gap = bound.components["attention.dsa_core"] - exact.components["attention.dsa_core"]
    assert gap == dsa_core_per_pair(dsa) * short


_BASE = ["--seq-len", "32", "--global-batch-size", "2", "--micro-batch-size", "2", "--warmup-steps", "0"]
_BASE += ["--log-interval", "1", "--lr", "1e-2"]
