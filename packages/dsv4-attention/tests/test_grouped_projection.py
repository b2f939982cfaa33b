"""The strided-GEMM grouped output projection (``wo_a``) against its einsum reference: exact in fp64 with every
gradient (gradcheck), odd shapes and zero tokens; bf16 on the GPU within 2x of einsum's own bf16 error."""

import pytest
import torch

from dsv4_attention.grouped_projection import grouped_projection, grouped_projection_ref
from dsv4_testkit import assert_close_to_ref

SHAPES = [(7, 2, 3, 5), (1, 8, 4, 16), (0, 2, 3, 4), (33, 3, 1, 7)]  # (T, g, d_g, n_in)


@pytest.mark.parametrize("t,g,r,i", SHAPES)
def test_matches_reference_fp64_with_gradients(t, g, r, i):
    torch.manual_seed(t + g)
    x = torch.randn(t, g * i, dtype=torch.float64, requires_grad=True)
    w = torch.randn(g, r, i, dtype=torch.float64, requires_grad=True)
    out, ref = grouped_projection(x, w), grouped_projection_ref(x, w)
    assert out.shape == (t, g * r) and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    gout = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, w), gout)
    want = torch.autograd.grad(ref, (x, w), gout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(grouped_projection, (x, w))


def test_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="g\\*n_in"):
        grouped_projection(torch.randn(3, 10), torch.randn(2, 4, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("t,g,r,i", [(4096, 8, 1024, 4096), (37, 8, 64, 96)])
def test_bf16_gpu_within_2x_of_einsum(t, g, r, i):
    torch.manual_seed(0)
    x = torch.randn(t, g * i, device="cuda") / 8
    w = torch.randn(g, r, i, device="cuda") / 64
    gout = torch.randn(t, g * r, device="cuda")
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    ref = grouped_projection_ref(xr, wr)
    ref_grads = torch.autograd.grad(ref, (xr, wr), gout.double())
    results = []
    for fn in (grouped_projection, grouped_projection_ref):
        xb, wb = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
        out = fn(xb, wb)
        results.append((out, *torch.autograd.grad(out, (xb, wb), gout.bfloat16())))
    for name, ours, theirs, want in zip(("out", "dx", "dw"), results[0], results[1], (ref, *ref_grads)):
        assert_close_to_ref(name, ours, want, theirs)
