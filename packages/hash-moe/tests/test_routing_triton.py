"""Fused Triton routing kernel (interpreter on CPU, compiled on GPU) vs the PyTorch routing: experts, weights,
scores and the logits gradient through both weights and scores."""

import pytest
import torch

from dsv4_testkit import assert_close_to_ref
from hash_moe import SCORE_FUNCTIONS, RouterConfig, topk_route

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _run(backend, logits, cfg, bias, valid, gw, gs):
    z = logits.detach().clone().requires_grad_()
    r = topk_route(z, cfg, selection_bias=bias, valid=valid, backend=backend)
    (dz,) = torch.autograd.grad((r.weights * gw).sum() + (r.scores * gs).sum(), z)
    return r, dz


@pytest.mark.parametrize("fn", SCORE_FUNCTIONS)
@pytest.mark.parametrize("n,e,k", [(1, 4, 1), (37, 6, 2), (70, 33, 6), (16, 256, 6)])
@pytest.mark.parametrize("with_bias_and_padding", [False, True])
def test_fused_routing_matches_torch(fn, n, e, k, with_bias_and_padding):
    g = torch.Generator().manual_seed(n + e + k)
    cfg = RouterConfig(num_experts=e, topk=k, score_function=fn, routed_scaling_factor=1.5)
    logits = (torch.randn(n, e, generator=g) * 3).to(DEV)
    bias = valid = None
    if with_bias_and_padding:
        bias = (torch.randn(e, generator=g) * 0.2).to(DEV)
        valid = (torch.rand(n, generator=g) > 0.3).to(DEV)
    gw = torch.randn(n, k, generator=g).to(DEV)
    gs = torch.randn(n, e, generator=g).to(DEV)
    fused, dz = _run("triton", logits, cfg, bias, valid, gw, gs)
    ref, dz_ref = _run("reference", logits.double(), cfg, bias, valid, gw.double(), gs.double())
    assert torch.equal(fused.experts, ref.experts)
    assert_close_to_ref("weights", fused.weights, ref.weights)
    assert_close_to_ref("scores", fused.scores, ref.scores)
    assert_close_to_ref("dlogits", dz, dz_ref)


def test_fused_routing_very_negative_logits_and_empty():
    cfg = RouterConfig(num_experts=4, topk=2)
    z = torch.tensor([[-60.0, -30.0, -10.0, 0.5]], device=DEV)
    a = topk_route(z, cfg, backend="triton")
    b = topk_route(z.double(), cfg, backend="reference")
    assert torch.equal(a.experts, b.experts)
    torch.testing.assert_close(a.scores.double(), b.scores, rtol=1e-5, atol=0)
    empty = topk_route(torch.zeros(0, 4, device=DEV), cfg, backend="triton")
    assert empty.weights.shape == (0, 2) and empty.scores.shape == (0, 4)
    with pytest.raises(ValueError, match="backend"):
        topk_route(z, cfg, backend="cuda")


@pytest.mark.gpu
def test_fused_routing_bf16_logits_on_gpu():
    g = torch.Generator().manual_seed(0)
    cfg = RouterConfig(num_experts=256, topk=6, routed_scaling_factor=1.5)
    logits = (torch.randn(4096, 256, generator=g) * 2).bfloat16().cuda()
    bias = (torch.randn(256, generator=g) * 0.05).cuda()
    fused = topk_route(logits, cfg, selection_bias=bias)  # auto -> triton on CUDA
    ref = topk_route(logits.double(), cfg, selection_bias=bias, backend="reference")
    assert (fused.experts == ref.experts).float().mean() > 0.999  # exact ties aside
    same = fused.experts.eq(ref.experts).all(-1)
    torch.testing.assert_close(fused.weights[same].double(), ref.weights[same], rtol=1e-5, atol=1e-6)
