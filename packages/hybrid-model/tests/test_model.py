"""The assembled DSv4 model: construction, parameter counts of the built model (spec §9.3), fwd/bwd, MTP."""

import pytest
import torch

from hybrid_model.params import analytic_param_counts, build_meta_model, count_model_params
from hybrid_model.presets import get_preset


@pytest.mark.parametrize(
    ("name", "main", "mtp", "act"),
    [("v4-flash", 284.33, 6.61, 13.80), ("v4-pro", 1573.0, 25.84, 49.78)],
)
def test_built_meta_model_counts_match_spec(megatron_cpu, name, main, mtp, act):
    cfg = get_preset(name)
    model = build_meta_model(cfg)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    c = count_model_params(model, cfg)
    assert round(c.main / 1e9, 2) == pytest.approx(main, abs=0.006)
    assert round(c.mtp / 1e9, 2) == pytest.approx(mtp, abs=0.006)
    assert round(c.activated / 1e9, 2) == pytest.approx(act, abs=0.006)
    a = analytic_param_counts(cfg)
    assert (c.main, c.mtp, c.activated, c.attention) == (a.main, a.mtp, a.activated, a.attention)


def test_tiny_structure_and_hash_layers(megatron_cpu):
    from hash_moe.megatron import DSv4MoELayer
    from hybrid_model.model import build_model

    cfg = get_preset("tiny")
    model = build_model(cfg)
    kinds = [type(layer.inner_layer.self_attention).__name__ for layer in model.decoder.layers[::2]]
    assert kinds == ["DSv4HybridAttention"] * 6
    ratios = [layer.inner_layer.self_attention.compress_ratio for layer in model.decoder.layers[::2]]
    assert ratios == [0, 4, 128, 4, 128, 4]
    moes = [layer.inner_layer.mlp for layer in model.decoder.layers[1::2]]
    assert all(isinstance(m, DSv4MoELayer) for m in moes)
    assert [m.is_hash_layer for m in moes] == [True, True, False, False, False, False]
    assert not model.mtp.block[1].inner_layer.mlp.is_hash_layer
    assert model.mtp.block[0].inner_layer.self_attention.compress_ratio == 0
    c = count_model_params(model, cfg)
    assert c.total == analytic_param_counts(cfg).total


def test_tiny_forward_backward_and_mtp(megatron_cpu):
    from hybrid_model.model import build_model

    torch.manual_seed(0)
    cfg = get_preset("tiny")
    model = build_model(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 37))
    labels = torch.roll(ids, -1, 1)
    loss = model(ids, None, None, labels=labels)
    assert loss.shape == (2, 37) and torch.isfinite(loss).all()
    assert model.last_mtp_loss is not None and torch.isfinite(model.last_mtp_loss)
    loss.mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []
    mtp_grads = [p.grad.abs().sum() for n, p in model.named_parameters() if n.startswith("mtp.")]
    assert all(g > 0 for g in mtp_grads)
    logits = model.compute_logits(ids)
    assert logits.shape == (2, 37, cfg.vocab_size)


def test_indexer_loss_set_follows_the_phase(megatron_cpu, monkeypatch):
    """Spec §5.2: the sparse phase's KL runs over the selected top-k (no dense student), the dense phase over every
    visible entry (the dense student ``LightningIndexer.scores``)."""
    from dsv4_attention.indexer import LightningIndexer
    from hybrid_model.model import build_model

    torch.manual_seed(0)
    cfg = get_preset("tiny")
    model = build_model(cfg).train()
    assert model.config.dsa_indexer_use_sparse_loss
    calls = []
    original = LightningIndexer.scores
    monkeypatch.setattr(
        LightningIndexer, "scores", lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    )
    ids = torch.randint(0, cfg.vocab_size, (1, 300))  # > 128 tokens: HCA and CSA entries exist
    for dense, want_calls in ((False, 0), (True, 3)):  # three CSA layers in tiny's main stack
        calls.clear()
        model.set_step_state(dense_attention=dense)
        loss = model(ids, None, None, labels=torch.roll(ids, -1, 1))
        loss.mean().backward()
        assert len(calls) == want_calls, (dense, len(calls))
        # the phase is model state (every attention layer, main and MTP), the megatron config is not written
        from dsv4_attention.megatron import DSv4HybridAttention

        layers = [m for m in model.modules() if isinstance(m, DSv4HybridAttention)]
        assert len(layers) == 7 and all(m.dense_attention == dense for m in layers)
        assert model.step_state.dense_attention == dense and model.config.csa_dense_mode is False
    model.set_step_state(dense_attention=False)
    assert model.step_state.mtp_loss_weight == cfg.mtp_loss_weight  # unchanged by the phase switches
    with pytest.raises(ValueError, match="mtp_loss_weight"):
        model.set_step_state(mtp_loss_weight=-1.0)


def test_causality_of_logits(megatron_cpu):
    """Oracle M2: logits at position t do not change when tokens > t change.

    T = 300 > 2·128: HCA entries exist (the second one, tokens 128..255, mixes kept and changed tokens and becomes
    visible only at t = 255), and CSA selects top-4 of up to 75 entries (sparse)."""
    from hybrid_model.model import build_model

    torch.manual_seed(1)
    cfg = get_preset("tiny")
    model = build_model(cfg)
    t, cut = 300, 200
    assert t // cfg.hca_compress_ratio >= 2 and t > cfg.csa_compress_ratio * cfg.index_topk
    ids = torch.randint(0, cfg.vocab_size, (1, t))
    ref = model.compute_logits(ids)
    ids2 = ids.clone()
    ids2[0, cut:] = (ids2[0, cut:] + 7) % cfg.vocab_size
    out = model.compute_logits(ids2)
    # expert GEMMs group tokens differently when later tokens change: equal up to fp32 rounding
    torch.testing.assert_close(ref[:, :cut], out[:, :cut], atol=1e-5, rtol=1e-5)
    assert (ref[:, cut:] - out[:, cut:]).abs().max() > 1e-3


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fused_cross_entropy_matches_megatron(megatron_cpu, monkeypatch, backend):
    """``cross_entropy_loss_fusion`` (our default: dsv4-primitives' fused CE) gives megatron's per-token LM and MTP
    losses and the same parameter gradients (incl. the in-place logits gradient of both heads)."""
    from hybrid_model.model import build_model

    monkeypatch.setenv("DSV4_PRIMITIVES_BACKEND", backend)
    cfg = get_preset("tiny")
    ids = torch.randint(0, cfg.vocab_size, (2, 23), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(ids, -1, 1)
    runs = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg, cross_entropy_loss_fusion=fused, fused_linear_cross_entropy=False).train()
        assert model.config.cross_entropy_loss_fusion is fused
        loss = model(ids, None, None, labels=labels)
        loss.mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        runs.append((loss.detach(), model.last_mtp_loss, grads))
    (l0, m0, g0), (l1, m1, g1) = runs
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m1, m0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fused_linear_cross_entropy_matches_unfused_head(megatron_cpu, monkeypatch, backend):
    """The default fused head (``linear_cross_entropy``: no [s, b, V] logits) gives the unfused head's (output layer
    logits + megatron's cross entropy) per-token LM and MTP losses and the same gradients of every parameter,
    the shared head weight included; without labels the model still returns the logits. The loss is reduced with the
    loss mask the model is given (the trainer's masked mean: the fused head's gradient-in-forward mode with the mask
    declared; zeros included)."""
    from hybrid_model.model import build_model

    monkeypatch.setenv("DSV4_PRIMITIVES_BACKEND", backend)
    cfg = get_preset("tiny")
    ids = torch.randint(0, cfg.vocab_size, (2, 23), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(ids, -1, 1)
    mask = (torch.arange(23) % 5 != 3).float().expand(2, 23).contiguous()  # [b, s]
    runs = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg, cross_entropy_loss_fusion=False, fused_linear_cross_entropy=fused).train()
        assert model.fused_linear_cross_entropy is fused
        loss = model(ids, None, None, labels=labels, loss_mask=mask)
        assert loss.shape == (2, 23) and loss.dtype == torch.float32
        ((loss * mask).sum() / mask.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        with torch.no_grad():
            logits = model.eval()(ids, None, None)
        runs.append((loss.detach(), model.last_mtp_loss, grads, logits))
    (l0, m0, g0, z0), (l1, m1, g1, z1) = runs
    assert z1.shape == (2, 23, cfg.vocab_size) and torch.equal(z0, z1)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m1, m0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and "output_layer.weight" in g1
    for n in g0:  # fp32: the chunked GEMMs sum in another order
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)
