"""Routing scores, learned top-k with selection bias (oracles E1, E3), padding, dense layout."""

import pytest
import torch
import torch.nn.functional as F

from dsv4_testkit import assert_close_to_ref
from hash_moe import SCORE_FUNCTIONS, RouterConfig, dense_routing, routing_scores, topk_route


def _scores64(logits, fn):
    z = logits.double()
    return {
        "sqrtsoftplus": F.softplus(z).sqrt(),
        "sigmoid": torch.sigmoid(z),
        "softmax": torch.softmax(z, -1),
    }[fn]


@pytest.mark.parametrize("fn", SCORE_FUNCTIONS)
def test_scores_fp32_match_formula(fn):
    torch.manual_seed(0)
    logits = torch.randn(7, 5, dtype=torch.bfloat16) * 4
    s = routing_scores(logits, fn)
    assert s.dtype == torch.float32
    torch.testing.assert_close(s.double(), _scores64(logits.float(), fn), rtol=1e-6, atol=1e-7)


def test_sqrtsoftplus_gradient_finite_for_very_negative_logits():
    z = torch.tensor([[-200.0, -50.0, 0.0, 30.0]], requires_grad=True)
    routing_scores(z, "sqrtsoftplus").sum().backward()
    assert torch.isfinite(z.grad).all()


@pytest.mark.parametrize("fn", SCORE_FUNCTIONS)
@pytest.mark.parametrize("scale", [1.0, 1.5, 2.5])
@pytest.mark.parametrize("n,e,k", [(1, 4, 1), (13, 8, 2), (9, 6, 6), (33, 16, 6)])
def test_e1_weights_sum_to_scaling_factor(fn, scale, n, e, k):
    torch.manual_seed(n * e + k)
    cfg = RouterConfig(num_experts=e, topk=k, score_function=fn, routed_scaling_factor=scale)
    bias = torch.randn(e) * 0.3
    r = topk_route(torch.randn(n, e) * 3, cfg, selection_bias=bias)
    torch.testing.assert_close(r.weights.sum(-1), torch.full((n,), scale), rtol=1e-6, atol=1e-6)
    assert r.experts.shape == (n, k)
    assert all(len(set(row)) == k for row in r.experts.tolist())


def test_e3_constant_bias_shift_changes_nothing():
    torch.manual_seed(1)
    cfg = RouterConfig(num_experts=8, topk=3, routed_scaling_factor=1.5)
    logits = torch.randn(40, 8)
    bias = torch.randn(8) * 0.1
    a = topk_route(logits, cfg, selection_bias=bias)
    b = topk_route(logits, cfg, selection_bias=bias + 0.25)
    assert torch.equal(a.experts.sort(-1).values, b.experts.sort(-1).values)
    torch.testing.assert_close(a.weights.sort(-1).values, b.weights.sort(-1).values, rtol=0, atol=1e-7)


def test_e3_bias_moves_selection_weights_from_unbiased_scores():
    torch.manual_seed(2)
    cfg = RouterConfig(num_experts=6, topk=2, routed_scaling_factor=2.5)
    logits = torch.randn(50, 6)
    plain = topk_route(logits, cfg)
    bias = torch.zeros(6)
    bias[5] = 10.0  # expert 5 is always selected
    biased = topk_route(logits, cfg, selection_bias=bias)
    assert (biased.experts == 5).any(-1).all()
    assert not (plain.experts == 5).any(-1).all()
    s = _scores64(logits, "sqrtsoftplus")
    chosen = s.gather(1, biased.experts)
    want = 2.5 * chosen / chosen.sum(-1, keepdim=True)
    torch.testing.assert_close(biased.weights.double(), want, rtol=1e-6, atol=1e-7)


def test_no_gradient_into_bias_and_weights_differentiable():
    torch.manual_seed(3)
    cfg = RouterConfig(num_experts=8, topk=2, routed_scaling_factor=1.5)
    logits = torch.randn(11, 8, requires_grad=True)
    bias = torch.randn(8, requires_grad=True)
    r = topk_route(logits, cfg, selection_bias=bias)
    g = torch.randn_like(r.weights)
    (gl,) = torch.autograd.grad((r.weights * g).sum(), logits)
    assert bias.grad is None
    logits64 = logits.detach().double().requires_grad_()
    s = _scores64(logits64, "sqrtsoftplus")
    chosen = s.gather(1, r.experts)
    ref = 1.5 * chosen / chosen.sum(-1, keepdim=True)
    (gr,) = torch.autograd.grad((ref * g.double()).sum(), logits64)
    assert_close_to_ref("dlogits", gl, gr)


def test_padding_tokens_zero_weight_never_dispatched():
    torch.manual_seed(4)
    cfg = RouterConfig(num_experts=5, topk=2)
    valid = torch.tensor([True, False, True, False])
    r = topk_route(torch.randn(4, 5), cfg, valid=valid)
    assert (r.weights[~valid] == 0).all() and (r.weights[valid] > 0).all()
    probs, rmap = dense_routing(r, 5)
    assert not rmap[~valid].any() and (rmap[valid].sum(-1) == 2).all()
    torch.testing.assert_close(probs.sum(-1), r.weights.sum(-1))
    assert torch.equal(probs > 0, rmap)


def test_empty_batch():
    cfg = RouterConfig(num_experts=4, topk=2)
    r = topk_route(torch.zeros(0, 4), cfg, valid=torch.zeros(0, dtype=torch.bool))
    probs, rmap = dense_routing(r, 4)
    assert r.weights.shape == (0, 2) and probs.shape == (0, 4) and rmap.shape == (0, 4)


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="topk"):
        RouterConfig(num_experts=4, topk=5)
    with pytest.raises(ValueError, match="score_function"):
        RouterConfig(num_experts=4, topk=2, score_function="relu")
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        RouterConfig(num_experts=4, topk=2, routed_scaling_factor=0.0)
    cfg = RouterConfig(num_experts=4, topk=2)
    with pytest.raises(ValueError, match="logits"):
        topk_route(torch.zeros(3, 5), cfg)
    with pytest.raises(ValueError, match="selection_bias"):
        topk_route(torch.zeros(3, 4), cfg, selection_bias=torch.zeros(3))
    with pytest.raises(ValueError, match="valid"):
        topk_route(torch.zeros(3, 4), cfg, valid=torch.ones(3))
