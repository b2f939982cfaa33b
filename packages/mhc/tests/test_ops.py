"""Triton kernels vs the references: outputs and every gradient.

CPU (interpreter): fp32 kernels, truth = float64 reference, yardstick = the fp32 reference.
GPU (``gpu`` marker): bf16 streams with fp32 parameters, truth = fp32 reference, yardstick = the reference run in bf16.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _kernel_cases import _compare, _params, _run, _triplet

from mhc import (
    hyper_head,
    hyper_head_ref,
    mhc_coefficients,
    mhc_coefficients_ref,
    mhc_collapse,
    mhc_collapse_ref,
    mhc_post,
    mhc_post_ref,
    mhc_pre,
    mhc_pre_ref,
)

# (T, N, D, iters): length 1, odd T, N not a power of two, N = 1, D not a multiple of the block, full 20 iterations
CPU_CASES = [(1, 4, 8, 3), (37, 4, 24, 5), (19, 3, 20, 2), (5, 1, 16, 1), (18, 2, 40, 20)]
GPU_CASES = [(1, 4, 64, 20), (1000, 4, 512, 20), (4097, 4, 4096, 20), (333, 3, 200, 20)]


def _cases(cases, dtype, device):
    return [
        pytest.param(*c, dtype, device, id="T{}-N{}-D{}-it{}".format(*c) + f"-{str(dtype)[6:]}")
        for c in cases
    ]


ALL = _cases(CPU_CASES, torch.float32, "cpu") + [
    pytest.param(*p.values, marks=pytest.mark.gpu, id=p.id) for p in _cases(GPU_CASES, torch.bfloat16, "cuda")
]


@pytest.mark.parametrize(("t", "n", "d", "iters", "dtype", "device"), ALL)
def test_mhc_coefficients(t, n, d, iters, dtype, device):
    kern, truth, yard = _triplet(t, n, d, dtype, device)
    kw = dict(sinkhorn_iters=iters)
    out, grads = _run(lambda *a: mhc_coefficients(*a, backend="triton", **kw), kern)
    ref, ref_g = _run(lambda *a: mhc_coefficients_ref(*a, **kw), truth)
    low, low_g = _run(lambda *a: mhc_coefficients_ref(*a, upcast=False, **kw), yard)
    _compare(["pre", "post", "comb"], out, ref, low)
    _compare(["dx", "dfn", "dscale", "dbase"], grads, ref_g, low_g)


@pytest.mark.parametrize(("t", "n", "d", "iters", "dtype", "device"), ALL)
def test_mhc_pre_fused(t, n, d, iters, dtype, device):
    kern, truth, yard = _triplet(t, n, d, dtype, device, seed=3)
    kw = dict(sinkhorn_iters=iters)
    out, grads = _run(lambda *a: mhc_pre(*a, backend="triton", **kw), kern)
    ref, ref_g = _run(lambda *a: mhc_pre_ref(*a, **kw), truth)
    low, low_g = _run(lambda *a: mhc_pre_ref(*a, upcast=False, **kw), yard)
    assert out[0].dtype == kern[0].dtype
    _compare(["x_in", "post", "comb"], out, ref, low)
    _compare(["dx", "dfn", "dscale", "dbase"], grads, ref_g, low_g)


@pytest.mark.parametrize(("t", "n", "d", "iters", "dtype", "device"), ALL)
def test_hyper_head(t, n, d, iters, dtype, device):
    kern, truth, yard = _triplet(t, n, d, dtype, device, head=True, seed=5)
    out, grads = _run(lambda *a: hyper_head(*a, backend="triton"), kern)
    ref, ref_g = _run(lambda *a: hyper_head_ref(*a), truth)
    low, low_g = _run(lambda *a: hyper_head_ref(*a, upcast=False), yard)
    _compare(["h"], out, ref, low)
    _compare(["dx", "dfn", "dscale", "dbase"], grads, ref_g, low_g)


def _mix_inputs(t, n, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, d, generator=g, dtype=torch.float64)
    f = torch.randn(t, d, generator=g, dtype=torch.float64)
    post = 2 * torch.rand(t, n, generator=g, dtype=torch.float64)
    comb = torch.rand(t, n, n, generator=g, dtype=torch.float64)  # deliberately not symmetric
    base = [f, x, post, comb]
    base = [b.to(device) for b in base]
    if dtype == torch.float32:
        k = [b.float() for b in base]
        return k, base, k
    k = [base[0].to(dtype), base[1].to(dtype), base[2].float(), base[3].float()]
    return k, [k[0].float(), k[1].float(), k[2], k[3]], [k[0], k[1], k[2].to(dtype), k[3].to(dtype)]


@pytest.mark.parametrize(("t", "n", "d", "iters", "dtype", "device"), ALL)
def test_mhc_post(t, n, d, iters, dtype, device):
    kern, truth, yard = _mix_inputs(t, n, d, dtype, device)
    out, grads = _run(lambda *a: mhc_post(*a, backend="triton"), kern)
    ref, ref_g = _run(mhc_post_ref, truth)
    low, low_g = _run(lambda *a: mhc_post_ref(*a, upcast=False), yard)
    _compare(["out"], out, ref, low)
    _compare(["df", "dx", "dpost", "dcomb"], grads, ref_g, low_g)


@pytest.mark.parametrize(("t", "n", "d", "iters", "dtype", "device"), ALL)
def test_mhc_collapse(t, n, d, iters, dtype, device):
    kern, truth, yard = _mix_inputs(t, n, d, dtype, device, seed=2)
    sel = lambda ins: [ins[1], ins[2]]  # (x, weights)
    out, grads = _run(lambda *a: mhc_collapse(*a, backend="triton"), sel(kern))
    ref, ref_g = _run(mhc_collapse_ref, sel(truth))
    low, low_g = _run(lambda *a: mhc_collapse_ref(*a, upcast=False), sel(yard))
    _compare(["x_in"], out, ref, low)
    _compare(["dx", "dpre"], grads, ref_g, low_g)


def test_empty_tokens():
    x = torch.zeros(0, 4, 8, requires_grad=True)
    fn, scale, base = (p.float() for p in _params(4, 8, 0))
    x_in, post, comb = mhc_pre(x, fn, scale, base, backend="triton")
    assert x_in.shape == (0, 8) and post.shape == (0, 4) and comb.shape == (0, 4, 4)
    f = torch.zeros(0, 8, requires_grad=True)
    out = mhc_post(f, x, post, comb, backend="triton")
    (x_in.sum() + out.sum()).backward()
    assert x.grad.shape == x.shape


def test_leading_dims_sbhd():
    # [S, B, N, D] streams (megatron layout) give the same result as flattened tokens
    x = torch.randn(3, 2, 4, 16)
    fn, scale, base = (p.float() for p in _params(4, 16, 1))
    a = mhc_pre(x, fn, scale, base, sinkhorn_iters=3, backend="triton")
    b = mhc_pre(x.reshape(6, 4, 16), fn, scale, base, sinkhorn_iters=3, backend="triton")
    for u, v in zip(a, b):
        torch.testing.assert_close(u.reshape(v.shape), v)
