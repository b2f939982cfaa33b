"""Clamped SwiGLU (oracle E4): fp32 activation, custom backward vs autograd of the reference."""

import pytest
import torch
import torch.nn.functional as F

from dsv4_testkit import assert_close_to_ref
from hash_moe import clamped_swiglu, clamped_swiglu_ref


def test_e4_clamp_semantics():
    gate = torch.tensor([-20.0, -0.7, 0.3, 0.7, 20.0])
    up = torch.tensor([-20.0, -0.7, 0.3, 0.7, 20.0])
    out = clamped_swiglu(torch.cat([gate, up]).unsqueeze(0), 0.5)[0]
    want = F.silu(gate.clamp(max=0.5)) * up.clamp(-0.5, 0.5)
    torch.testing.assert_close(out, want)
    # the gate is clipped from above only: a very negative gate stays (silu -> ~0), not raised to -limit
    symmetric = F.silu(torch.tensor(-0.5)) * -0.5
    assert out[0].abs() < 1e-6 and (out[0] - symmetric).abs() > 0.05
    plain = clamped_swiglu(torch.cat([gate, up]).unsqueeze(0), None)[0]
    torch.testing.assert_close(plain, F.silu(gate) * up)


@pytest.mark.parametrize("limit", [None, 0.5, 10.0])
@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("m,f", [(1, 1), (7, 5), (33, 16)])
def test_forward_backward_match_reference(limit, with_probs, m, f):
    torch.manual_seed(m * f)
    x = (torch.randn(m, 2 * f, dtype=torch.float64) * 3).requires_grad_()
    p = torch.rand(m, dtype=torch.float64, requires_grad=True) if with_probs else None
    g = torch.randn(m, f, dtype=torch.float64)
    a, b = x.chunk(2, -1)
    ref = clamped_swiglu_ref(a, b, limit) * (p.unsqueeze(-1) if with_probs else 1)
    inputs = (x, p) if with_probs else (x,)
    ref_grads = torch.autograd.grad((ref * g).sum(), inputs)
    # fp32 path against the fp64 reference
    x32 = x.detach().float().requires_grad_()
    p32 = p.detach().float().requires_grad_() if with_probs else None
    out = clamped_swiglu(x32, limit, p32)
    assert out.dtype == torch.float32
    grads = torch.autograd.grad((out * g.float()).sum(), (x32, p32) if with_probs else (x32,))
    assert_close_to_ref("out", out, ref)
    for name, got, want in zip(("dx", "dprobs"), grads, ref_grads):
        assert_close_to_ref(name, got, want)


def test_clamp_boundary_gradient_matches_torch_clamp():
    lim = 0.5
    x = torch.tensor([[0.5, -0.5, 0.5, -0.5]], dtype=torch.float64, requires_grad=True)  # values at the limit
    (gx,) = torch.autograd.grad(clamped_swiglu(x, lim).sum(), x)
    x2 = x.detach().clone().requires_grad_()
    a, b = x2.chunk(2, -1)
    (gr,) = torch.autograd.grad(clamped_swiglu_ref(a, b, lim).sum(), x2)
    torch.testing.assert_close(gx, gr)


def test_bf16_within_tolerance_rule():
    torch.manual_seed(0)
    x = torch.randn(64, 48) * 4
    p = torch.rand(64)
    g = torch.randn(64, 24)
    ref32 = clamped_swiglu_ref(*x.double().chunk(2, -1), 2.0) * p.double().unsqueeze(-1)
    ref_bf = clamped_swiglu_ref(*x.bfloat16().chunk(2, -1), 2.0) * p.bfloat16().unsqueeze(-1)
    xb = x.bfloat16().requires_grad_()
    out = clamped_swiglu(xb, 2.0, p.bfloat16())
    assert out.dtype == torch.bfloat16
    assert_close_to_ref("out_bf16", out, ref32, ref_bf)
    out.backward(g.bfloat16())
    x64 = x.double().requires_grad_()
    (clamped_swiglu_ref(*x64.chunk(2, -1), 2.0) * p.double().unsqueeze(-1)).backward(g.double())
    xbf = x.bfloat16().requires_grad_()
    (clamped_swiglu_ref(*xbf.chunk(2, -1), 2.0) * p.bfloat16().unsqueeze(-1)).backward(g.bfloat16())
    assert_close_to_ref("dx_bf16", xb.grad, x64.grad, xbf.grad)


def test_bad_inputs():
    with pytest.raises(ValueError, match="limit"):
        clamped_swiglu(torch.zeros(2, 4), -1.0)
    with pytest.raises(ValueError, match="even"):
        clamped_swiglu(torch.zeros(2, 3), 1.0)
    with pytest.raises(ValueError, match="probs"):
        clamped_swiglu(torch.zeros(2, 4), 1.0, torch.zeros(3))
