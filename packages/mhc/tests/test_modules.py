"""Modules, dispatcher and input validation."""

from __future__ import annotations

import pytest
import torch

from dsv4_primitives.dispatch import resolve_backend as _resolve
from mhc import (
    HyperHead,
    ManifoldHyperConnection,
    MHCConfig,
    StreamExpansion,
    expand_streams,
    mhc_coefficients,
    mhc_post,
    mhc_pre,
)


def _grads(module, x):
    x = x.detach().clone().requires_grad_(True)
    x_in, post, comb = module(x)
    f = torch.tanh(x_in)
    out = module.post(f, x, post, comb)
    (out.square().sum() + x_in.sum()).backward()
    return [x.grad] + [p.grad.clone() for p in module.parameters()]


def test_init_and_fp32_marking():
    hc = ManifoldHyperConnection(MHCConfig(hidden_size=16, num_streams=4))
    assert hc.fn.shape == (24, 64) and hc.base.shape == (24,) and hc.scale.shape == (3,)
    assert torch.all(hc.base == 0) and torch.allclose(hc.scale, torch.full((3,), 0.01))
    hc = hc.to(torch.bfloat16)
    assert all(p.dtype == torch.float32 and p.keep_in_fp32 for p in hc.parameters())
    head = HyperHead(MHCConfig(hidden_size=16, num_streams=4)).half()
    assert head.fn.shape == (4, 64) and head.scale.shape == (1,)
    assert all(p.dtype == torch.float32 for p in head.parameters())


def test_initial_block_is_near_uniform_average():
    # base = 0, small gates: post ≈ 1, comb ≈ J / n (§6.5)
    hc = ManifoldHyperConnection(MHCConfig(hidden_size=16, num_streams=4, backend="reference"))
    _, post, comb = hc(torch.randn(3, 4, 16))
    assert torch.allclose(post, torch.ones_like(post), atol=0.02)
    assert torch.allclose(comb, torch.full_like(comb, 0.25), atol=0.01)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_recompute_coefficients_same_grads(backend):
    torch.manual_seed(0)
    cfg = MHCConfig(hidden_size=8, num_streams=4, sinkhorn_iters=3, backend=backend)
    a = ManifoldHyperConnection(cfg)
    b = ManifoldHyperConnection(
        MHCConfig(
            hidden_size=8, num_streams=4, sinkhorn_iters=3, backend=backend, recompute_coefficients=True
        )
    )
    with torch.no_grad():
        a.fn.normal_(std=0.5)
        a.scale.fill_(1.0)
    b.load_state_dict(a.state_dict())
    x = torch.randn(6, 4, 8)
    for ga, gb in zip(_grads(a, x), _grads(b, x)):
        torch.testing.assert_close(ga, gb, atol=1e-6, rtol=1e-5)


def test_backends_agree_through_modules():
    torch.manual_seed(1)
    x = torch.randn(2, 3, 4, 8)
    a = ManifoldHyperConnection(MHCConfig(hidden_size=8, sinkhorn_iters=4, backend="reference"))
    b = ManifoldHyperConnection(MHCConfig(hidden_size=8, sinkhorn_iters=4, backend="triton"))
    with torch.no_grad():
        a.fn.normal_(std=0.5)
    b.load_state_dict(a.state_dict())
    for ga, gb in zip(_grads(a, x), _grads(b, x)):
        torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-4)


def test_expansion():
    h = torch.randn(3, 2, 8, requires_grad=True)
    x = StreamExpansion(MHCConfig(hidden_size=8, num_streams=4))(h)
    assert x.shape == (3, 2, 4, 8) and x.dtype == torch.float32
    assert torch.equal(x[:, :, 2], h)
    x.sum().backward()
    assert torch.equal(h.grad, torch.full_like(h, 4.0))
    assert expand_streams(h.bfloat16(), 2, torch.float32).dtype == torch.float32


def resolve_backend(backend, *tensors):
    return _resolve(backend, *tensors, op="mhc.mhc_pre")


def test_dispatch(monkeypatch):
    """mhc's ops resolve through dsv4_primitives.dispatch with MHC_BACKEND as their package variable."""
    monkeypatch.delenv("DSV4_BACKEND", raising=False)
    cpu = torch.zeros(1)
    monkeypatch.delenv("MHC_BACKEND", raising=False)
    assert resolve_backend("auto", cpu) == "reference"
    assert resolve_backend("triton", cpu) == "triton"  # interpreter is on in the CPU suite
    monkeypatch.setenv("MHC_BACKEND", "triton")
    assert resolve_backend("auto", cpu) == "triton"
    assert resolve_backend("reference", cpu) == "reference"  # explicit choice wins over the env
    monkeypatch.setenv("MHC_BACKEND", "cuda")
    with pytest.raises(ValueError, match="MHC_BACKEND"):
        resolve_backend("auto", cpu)
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("fast", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        resolve_backend("triton", cpu)


def test_bad_inputs():
    x = torch.randn(3, 4, 8)
    fn, scale, base = torch.zeros(24, 32), torch.ones(3), torch.zeros(24)
    with pytest.raises(ValueError, match="fn must be"):
        mhc_pre(x, torch.zeros(24, 31), scale, base)
    with pytest.raises(ValueError, match="scale"):
        mhc_coefficients(x, fn, torch.ones(2), base)
    with pytest.raises(ValueError, match="streams"):
        mhc_pre(torch.randn(8), fn, scale, base)
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        mhc_pre(x, fn, scale, base, sinkhorn_iters=0)
    with pytest.raises(ValueError, match="post/comb"):
        mhc_post(torch.randn(3, 8), x, torch.randn(3, 4), torch.randn(3, 4, 3))
    with pytest.raises(ValueError, match="f must"):
        mhc_post(torch.randn(3, 7), x, torch.randn(3, 4), torch.randn(3, 4, 4))
    with pytest.raises(ValueError, match="num_streams"):
        MHCConfig(hidden_size=8, num_streams=0)
    with pytest.raises(ValueError, match="backend"):
        MHCConfig(hidden_size=8, backend="cuda")
    hc = ManifoldHyperConnection(MHCConfig(hidden_size=8))
    with pytest.raises(ValueError, match="streams must be"):
        hc(torch.randn(3, 2, 8))
