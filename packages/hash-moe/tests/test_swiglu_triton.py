"""Fused Triton clamped SwiGLU (interpreter on CPU, compiled on GPU) vs the fp64 reference: output and the
gradients of gate_up and probs, clamp boundaries, odd shapes, empty input, dispatch; bf16 at model size on GPU."""

import pytest
import torch

from dsv4_testkit import assert_close_to_ref
from hash_moe import clamped_swiglu, clamped_swiglu_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_LIMIT = 0.75  # exact in bf16: inputs can sit exactly on +-limit


def _inputs(m, f, limit, dtype, with_probs, seed, device=DEV, scale=3.0):
    """``gate_up [M, 2F]``, ``probs [M]`` or None, ``dh [M, F]``; some entries exactly at +-limit."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * f, generator=g) * scale
    if limit is not None and x.numel():
        hit = torch.rand(m, 2 * f, generator=g) < 0.15
        sign = torch.where(torch.rand(m, 2 * f, generator=g) < 0.5, -1.0, 1.0)
        x = torch.where(hit, sign * limit, x)
    p = torch.rand(m, generator=g) + 0.25 if with_probs else None
    dh = torch.randn(m, f, generator=g)
    return x.to(device, dtype), (p.to(device, dtype) if p is not None else None), dh.to(device, dtype)


def _ref(x, p, dh, limit, dtype):
    """``(h, d gate_up, d probs)`` of the autograd-traced reference evaluated in ``dtype``."""
    xr = x.detach().to(dtype).requires_grad_()
    pr = p.detach().to(dtype).requires_grad_() if p is not None else None
    a, b = xr.chunk(2, dim=-1)
    h = clamped_swiglu_ref(a, b, limit)
    if pr is not None:
        h = h * pr.unsqueeze(-1)
    grads = torch.autograd.grad(h, (xr, pr) if pr is not None else (xr,), dh.to(dtype))
    return (h.detach(), *grads)


def _fused(x, p, dh, limit, backend="triton"):
    xf = x.detach().clone().requires_grad_()
    pf = p.detach().clone().requires_grad_() if p is not None else None
    h = clamped_swiglu(xf, limit, pf, backend=backend)
    grads = torch.autograd.grad(h, (xf, pf) if pf is not None else (xf,), dh)
    return (h.detach(), *grads)


def _check_against_reference(x, p, dh, limit):
    got = _fused(x, p, dh, limit)
    ref64 = _ref(x, p, dh, limit, torch.float64)
    same = _ref(x, p, dh, limit, x.dtype) if x.dtype != torch.float32 else (None,) * len(ref64)
    for name, a, r, s in zip(("h", "dgate_up", "dprobs"), got, ref64, same):
        assert a.dtype == (p.dtype if name == "dprobs" else x.dtype)
        assert_close_to_ref(name, a, r, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [None, 10.0, SMALL_LIMIT])
@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("m,f", [(1, 1), (7, 7), (33, 100), (5, 16)])
def test_fused_matches_fp64_reference(dtype, limit, with_probs, m, f):
    scale = 6.0 if limit == 10.0 else 3.0  # limit 10: some values past the clamp; 0.75: most of them
    x, p, dh = _inputs(m, f, limit, dtype, with_probs, seed=m * 1000 + f, scale=scale)
    _check_against_reference(x, p, dh, limit)


def test_values_exactly_at_the_limit_pass_the_gradient():
    lim = SMALL_LIMIT
    # gate: at +L (kept), past +L (cut), at -L (gate is clipped from above only); up: at -L and +L kept
    x = torch.tensor([[lim, lim + 1.0, -lim, 0.3, -lim, lim, 2.0, -2.0]], device=DEV)
    p = torch.tensor([0.5], device=DEV)
    dh = torch.ones(1, 4, device=DEV)
    got = _fused(x, p, dh, lim)
    ref = _ref(x, p, dh, lim, torch.float64)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a.double(), r, rtol=1e-6, atol=1e-7)
    dgate, dup = got[1][0, :4], got[1][0, 4:]
    assert dgate[0] != 0 and dgate[1] == 0 and dgate[2] != 0  # a == L passes, a > L is cut, a == -L passes
    assert dup[0] != 0 and dup[1] != 0 and dup[2] == 0 and dup[3] == 0  # b == +-L pass, |b| > L is cut


@pytest.mark.parametrize("with_probs", [False, True])
def test_empty_rows(with_probs):
    x, p, dh = _inputs(0, 5, 1.0, torch.float32, with_probs, seed=0)
    h, *grads = _fused(x, p, dh, 1.0)
    assert h.shape == (0, 5) and grads[0].shape == (0, 10)
    if with_probs:
        assert grads[1].shape == (0,)


@pytest.mark.parametrize("with_probs", [False, True])
def test_zero_width(with_probs):
    """F = 0 (an expert of width 0): empty outputs and gradients, zero d probs, as the PyTorch path."""
    x, p, dh = _inputs(3, 0, 1.0, torch.float32, with_probs, seed=0)
    h, *grads = _fused(x, p, dh, 1.0)
    assert h.shape == (3, 0) and grads[0].shape == (3, 0)
    if with_probs:
        assert torch.equal(grads[1], torch.zeros(3, device=grads[1].device))


def test_triton_on_cpu_without_interpreter_is_a_value_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        clamped_swiglu(torch.randn(2, 4), 10.0, backend="triton")


def test_leading_dims_strided_input_and_mixed_probs_dtype():
    """``[S, B, 2F]`` input that is a column slice of a wider tensor, fp32 probs with bf16 gate_up (megatron's
    permuted probs), a non-contiguous ``dh``."""
    g = torch.Generator().manual_seed(3)
    s, b, f = 5, 3, 12
    wide = (torch.randn(s, b, 2 * f + 6, generator=g) * 3).to(DEV, torch.bfloat16)
    x = wide[..., : 2 * f]  # row stride 2F + 6
    p = (torch.rand(s, b, generator=g) + 0.1).to(DEV)
    dh = torch.randn(b, s, f, generator=g).to(DEV, torch.bfloat16).transpose(0, 1)  # [S, B, F], strided
    got = _fused(x, p, dh, 2.0)
    ref64 = _ref(x, p, dh, 2.0, torch.float64)
    same = _ref(x, p, dh, 2.0, torch.bfloat16)
    assert got[0].shape == (s, b, f) and got[1].shape == x.shape and got[2].dtype == torch.float32
    for name, a, r, sd in zip(("h", "dgate_up", "dprobs"), got, ref64, same):
        assert_close_to_ref(name, a, r, sd)


def test_probs_without_gradient_and_nan_propagation():
    x, p, dh = _inputs(9, 24, SMALL_LIMIT, torch.float32, True, seed=5)
    xf = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(clamped_swiglu(xf, SMALL_LIMIT, p, backend="triton"), xf, dh)  # no d probs
    assert_close_to_ref("dgate_up", dx, _ref(x, p, dh, SMALL_LIMIT, torch.float64)[1])
    x[0, 3] = float("nan")  # a gate
    x[1, 24 + 2] = float("nan")  # an up value
    for backend in ("triton", "reference"):
        h = clamped_swiglu(x, SMALL_LIMIT, p, backend=backend)
        assert torch.isnan(h[0, 3]) and torch.isnan(h[1, 2]) and torch.isnan(h).sum() == 2


def test_backend_dispatch_and_bad_inputs(monkeypatch):
    import hash_moe.kernels.swiglu_triton as kern

    calls = []
    launch = kern._launch_fwd
    monkeypatch.setattr(kern, "_launch_fwd", lambda *a: calls.append(1) or launch(*a))
    x = torch.randn(3, 8, device=DEV)
    clamped_swiglu(x, 1.0)  # auto: Triton on CUDA, PyTorch on CPU
    assert len(calls) == (1 if DEV == "cuda" else 0)
    clamped_swiglu(x.double(), 1.0)  # fp64 always takes the PyTorch path under auto
    assert len(calls) == (1 if DEV == "cuda" else 0)
    with pytest.raises(ValueError, match="fp64"):
        clamped_swiglu(x.double(), 1.0, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        clamped_swiglu(x, 1.0, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("limit", [None, 10.0, SMALL_LIMIT])
@pytest.mark.parametrize("probs_dtype", [None, torch.float32, torch.bfloat16])
def test_fused_bf16_model_size_on_gpu(limit, probs_dtype):
    """M = 4096 tokens x top-6, F = 2048, bf16 (the flash-smoke expert activation)."""
    m, f = 24576, 2048
    x, p, dh = _inputs(m, f, limit, torch.float32, probs_dtype is not None, seed=11, device="cpu", scale=4.0)
    x, dh = x.cuda().bfloat16(), dh.cuda().bfloat16()
    p = p.cuda().to(probs_dtype) if p is not None else None
    got = _fused(x, p, dh, limit)
    ref64 = _ref(x, p, dh, limit, torch.float64)
    same = _ref(x, p, dh, limit, torch.bfloat16)
    for name, a, r, s in zip(("h", "dgate_up", "dprobs"), got, ref64, same):
        if name == "dprobs" and probs_dtype == torch.float32:
            s = _ref(x, p, dh, limit, torch.float32)[2]  # fp32 probs: the fp32 sum is the yardstick
        assert_close_to_ref(name, a, r, s)


@pytest.mark.gpu
def test_model_expert_paths_run_the_fused_kernel_on_gpu(monkeypatch):
    """The routed experts (probs multiplied before w2) and the shared expert MLP dispatch to the Triton kernels."""
    import hash_moe.kernels.swiglu_triton as kern
    from hash_moe import grouped_swiglu_experts, swiglu_mlp

    calls = {"fwd": [], "bwd": []}
    fwd, bwd = kern._launch_fwd, kern._launch_bwd
    monkeypatch.setattr(
        kern, "_launch_fwd", lambda x, p, lim: calls["fwd"].append(p is not None) or fwd(x, p, lim)
    )
    monkeypatch.setattr(
        kern, "_launch_bwd", lambda x, p, *a: calls["bwd"].append(p is not None) or bwd(x, p, *a)
    )
    torch.manual_seed(0)
    h, f, g = 64, 32, 4
    x = torch.randn(96, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gu = (torch.randn(g, 2 * f, h, device="cuda") * h**-0.5).bfloat16().requires_grad_()
    dn = (torch.randn(g, h, f, device="cuda") * f**-0.5).bfloat16().requires_grad_()
    probs = torch.rand(96, device="cuda", requires_grad=True)
    counts = torch.tensor([24, 24, 24, 24])
    out = grouped_swiglu_experts(x, counts, gu, dn, limit=10.0, probs=probs)
    ref = grouped_swiglu_experts(x, counts, gu, dn, limit=10.0, probs=probs, activation_backend="reference")
    shared = swiglu_mlp(x, gu[0], dn[0], limit=10.0)
    (out.float().sum() + shared.float().sum()).backward()
    assert calls["fwd"] == [True, False] and sorted(calls["bwd"]) == [False, True]
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_backend_names_resolve_through_the_shared_rule(monkeypatch):
    """hash-moe's kernels resolve through ``dsv4_primitives.dispatch``: the former ``"torch"`` name of the reference
    is refused, ``HASH_MOE_BACKEND`` (then ``DSV4_BACKEND``) overrides ``auto``."""
    from hash_moe.row_gather import gather_rows

    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="backend must be one of"):
        clamped_swiglu(x, 1.0, backend="torch")
    with pytest.raises(ValueError, match="backend must be one of"):
        gather_rows(x, torch.tensor([2, -1]), backend="torch")
    monkeypatch.delenv("DSV4_BACKEND", raising=False)
    monkeypatch.setenv("HASH_MOE_BACKEND", "bogus")
    with pytest.raises(ValueError, match="HASH_MOE_BACKEND"):
        clamped_swiglu(x, 1.0)
