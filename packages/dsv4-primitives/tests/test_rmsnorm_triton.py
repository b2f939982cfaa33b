"""rms_norm (Triton under the interpreter on CPU, bf16 on GPU) vs the reference: outputs, dx, dweight, dispatch."""

import pytest
import torch

import dsv4_primitives.rmsnorm.apply as rms_apply
from dsv4_primitives import RMSNorm, rms_norm, rms_norm_ref
from dsv4_primitives.dispatch import resolve_backend
from dsv4_testkit import assert_close_to_ref, interpreting, max_abs_err

needs_triton = pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="needs CUDA or TRITON_INTERPRET=1"
)
ENV_VAR = "DSV4_PRIMITIVES_BACKEND"
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _grads(fn, x, w, gy):
    """Output and grads (dx, dw or None) of ``fn(x, w)`` for leaf copies of ``x`` / ``w``."""
    xl = x.detach().clone().requires_grad_(True)
    wl = w.detach().clone().requires_grad_(True) if w is not None else None
    y = fn(xl, wl)
    grads = torch.autograd.grad(y, [xl] + ([wl] if wl is not None else []), gy)
    return y.detach(), grads[0], (grads[1] if wl is not None else None)


def _truncate_to_bf16(t):
    """fp32 -> bf16 rounding toward zero (drop the low 16 bits), as the Triton interpreter casts."""
    bits = t.float().contiguous().view(torch.int32) & -65536  # 0xFFFF0000
    return bits.view(torch.float32).bfloat16()


def _check_against_reference(x, w, eps=1e-6, gy=None):
    """Triton vs the fp64 reference; the yardstick is the reference in the dtypes of ``x`` / ``w`` (rule 2x)."""
    gy = torch.randn(x.shape, device=x.device).to(x.dtype) if gy is None else gy
    y, dx, dw = _grads(lambda a, b: rms_norm(a, b, eps, backend="triton"), x, w, gy)
    yr, dxr, dwr = _grads(
        lambda a, b: rms_norm_ref(a, b, eps), x.double(), w.double() if w is not None else None, gy.double()
    )
    ys, dxs, dws = _grads(lambda a, b: rms_norm_ref(a, b, eps), x, w, gy)  # plain PyTorch, same dtypes
    if interpreting() and x.dtype == torch.bfloat16:
        # Triton 3.6's interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest even), so on CPU the
        # yardstick is the larger of the two roundings of the fp32-math reference.
        yf, dxf, _ = _grads(lambda a, b: rms_norm_ref(a, b, eps), x.float(), w, gy.float())
        ys = max(ys, _truncate_to_bf16(yf), key=lambda t: max_abs_err(t, yr))
        dxs = max(dxs, _truncate_to_bf16(dxf), key=lambda t: max_abs_err(t, dxr))
    assert y.dtype == x.dtype and dx.dtype == x.dtype and y.shape == x.shape
    assert_close_to_ref("y", y, yr, ys)
    assert_close_to_ref("dx", dx, dxr, dxs)
    if w is not None:
        assert dw.dtype == w.dtype and dw.shape == w.shape
        assert_close_to_ref("dw", dw, dwr, dws)
    return y, dx, dw


WEIGHTS = ["none", "fp32", "bf16"]


def _weight(kind, d, device=DEV):
    if kind == "none":
        return None
    w = 1 + 0.5 * torch.randn(d, device=device)
    return w.bfloat16() if kind == "bf16" else w


@needs_triton
@pytest.mark.parametrize("wkind", WEIGHTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(3, 1), (4, 7), (2, 3, 100), (5, 513), (1, 1, 64)], ids=str)
def test_matches_reference(shape, dtype, wkind):
    torch.manual_seed(0)
    x = (3 * torch.randn(shape, device=DEV)).to(dtype)
    _check_against_reference(x, _weight(wkind, shape[-1]))


@needs_triton
@pytest.mark.parametrize("wkind", ["none", "fp32"])
def test_chunked_wide_rows(monkeypatch, wkind):
    """Rows wider than the register tile loop over chunks (D > MAX_TILE_D; 8192 on GPU, shrunk here)."""
    monkeypatch.setattr(rms_apply, "MAX_TILE_D", 32)
    monkeypatch.setattr(rms_apply, "CHUNK_D", 16)
    monkeypatch.setattr(rms_apply, "_TILE_ELEMS_INTERPRET", 64)  # 4 rows per block (GPU: 4096 elements)
    torch.manual_seed(1)
    for d in (33, 100):  # partial last chunk
        x = torch.randn(37, d, device=DEV).bfloat16()  # 37 rows: 10 blocks on 4 backward programs
        _check_against_reference(x, _weight(wkind, d))


@needs_triton
def test_many_row_blocks_per_program_and_eps():
    """More row blocks than backward programs: each program reduces several blocks into its dw partial row."""
    torch.manual_seed(2)
    x = torch.randn(3000, 24, device=DEV)  # interpreter: BLOCK_R 512 -> 6 blocks on 4 programs
    x[5] = 0.0  # all-zero row: y = 0, rstd = eps^-1/2
    _check_against_reference(x, _weight("fp32", 24), eps=1e-5)


@needs_triton
@pytest.mark.parametrize("wkind", WEIGHTS)
def test_zero_rows(wkind):
    w = _weight(wkind, 16)
    for shape in [(0, 16), (2, 0, 16)]:
        x = torch.randn(shape, device=DEV).bfloat16().requires_grad_(True)
        wl = w.clone().requires_grad_(True) if w is not None else None
        y = rms_norm(x, wl, backend="triton")
        assert y.shape == shape and y.dtype == torch.bfloat16
        y.sum().backward()
        assert x.grad.shape == shape
        if wl is not None:
            assert wl.grad.dtype == w.dtype and torch.equal(wl.grad, torch.zeros_like(w))


@needs_triton
def test_non_contiguous_inputs_and_grad_output():
    torch.manual_seed(3)
    base = torch.randn(6, 4, 40, device=DEV)
    x = base.transpose(0, 1)  # [4, 6, 40], non-contiguous rows
    gy = torch.randn(40, 6, 4, device=DEV).permute(2, 1, 0)  # non-contiguous incoming gradient
    _check_against_reference(x, _weight("fp32", 40), gy=gy)
    xs = torch.randn(5, 80, device=DEV)[:, ::2]  # channel stride 2
    _check_against_reference(xs, None)
    w_strided = torch.randn(80, device=DEV)[::2]
    _check_against_reference(xs, w_strided)


@needs_triton
def test_only_weight_or_only_x_requires_grad():
    torch.manual_seed(4)
    x = torch.randn(9, 12, device=DEV)
    w = torch.randn(12, device=DEV).requires_grad_(True)
    (dw,) = torch.autograd.grad(rms_norm(x, w, backend="triton"), w, torch.ones(9, 12, device=DEV))
    (dwr,) = torch.autograd.grad(rms_norm_ref(x, w), w, torch.ones(9, 12, device=DEV))
    assert_close_to_ref("dw", dw, dwr)
    xl = x.clone().requires_grad_(True)
    (dx,) = torch.autograd.grad(rms_norm(xl, w.detach(), backend="triton"), xl, torch.ones(9, 12, device=DEV))
    xr = x.clone().requires_grad_(True)
    (dxr,) = torch.autograd.grad(rms_norm_ref(xr, w.detach()), xr, torch.ones(9, 12, device=DEV))
    assert_close_to_ref("dx", dx, dxr)


def test_fp64_and_reference_backend_take_the_reference():
    torch.manual_seed(5)
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, dtype=torch.float64, requires_grad=True)
    for backend in ("auto", "reference"):
        torch.testing.assert_close(rms_norm(x, w, backend=backend), rms_norm_ref(x, w), rtol=0, atol=0)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b), [x, w])


def test_dispatch_auto_env_and_errors(monkeypatch):
    cpu = torch.randn(2, 8)
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_backend("auto", cpu, op="dsv4_primitives.op") == "reference"
    monkeypatch.setenv(ENV_VAR, "reference")
    assert resolve_backend("auto", cpu, op="dsv4_primitives.op") == "reference"
    monkeypatch.setenv(ENV_VAR, "bogus")
    with pytest.raises(ValueError, match=ENV_VAR):
        rms_norm(cpu)
    monkeypatch.setenv(ENV_VAR, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=f"{ENV_VAR}=triton needs a CUDA tensor"):
        rms_norm(cpu)
    with pytest.raises(ValueError, match="backend='triton' needs a CUDA tensor"):
        rms_norm(cpu, backend="triton")
    assert resolve_backend("reference", cpu, op="dsv4_primitives.op") == "reference"  # explicit argument wins
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("auto", cpu, op="dsv4_primitives.op") == "triton"
    with pytest.raises(ValueError, match="backend must be one of"):
        rms_norm(cpu, backend="cuda")


@needs_triton
def test_auto_uses_triton_on_cuda_and_env_selects_it(monkeypatch):
    calls = []
    real = rms_apply._RMSNormFunction.apply
    monkeypatch.setattr(rms_apply._RMSNormFunction, "apply", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(3, 8, device=DEV)
    monkeypatch.delenv(ENV_VAR, raising=False)
    rms_norm(x)
    assert len(calls) == (1 if x.is_cuda else 0)  # auto: Triton on CUDA, the reference on CPU
    monkeypatch.setenv(ENV_VAR, "triton")
    torch.testing.assert_close(rms_norm(x), rms_norm_ref(x), rtol=0, atol=1e-6)
    assert len(calls) == (2 if x.is_cuda else 1)
    rms_norm(x, backend="reference")
    assert len(calls) == (2 if x.is_cuda else 1)


def test_bad_inputs_raise_value_error():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"must be \[8\]"):
        rms_norm(x, torch.ones(7))
    with pytest.raises(ValueError, match="floating-point"):
        rms_norm(torch.ones(3, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="floating-point"):
        rms_norm(x, torch.ones(8, dtype=torch.long))
    with pytest.raises(ValueError, match="scalar"):
        rms_norm(torch.tensor(1.0))


@needs_triton
@pytest.mark.parametrize("affine", [True, False])
def test_module_uses_rms_norm(affine):
    torch.manual_seed(6)
    norm = RMSNorm(24, eps=1e-5, elementwise_affine=affine, backend="triton").to(DEV)
    if affine:
        with torch.no_grad():
            norm.weight.copy_(1 + 0.3 * torch.randn(24))
    x = torch.randn(2, 5, 24, device=DEV).bfloat16()
    gy = torch.randn(2, 5, 24, device=DEV).bfloat16()
    xl = x.clone().requires_grad_(True)
    out = norm(xl)
    out.backward(gy)
    w = norm.weight.detach().clone() if affine else None
    y, dx, dw = _check_against_reference(x, w, eps=1e-5, gy=gy)  # rms_norm(backend="triton") vs the reference
    torch.testing.assert_close(out.detach(), y, rtol=0, atol=0)
    torch.testing.assert_close(xl.grad, dx, rtol=0, atol=0)
    if affine:
        assert norm.weight.grad.dtype == torch.float32
        torch.testing.assert_close(norm.weight.grad, dw, rtol=0, atol=0)


def test_module_default_backend_is_auto():
    norm = RMSNorm(8)
    assert norm.backend == "auto"
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), rms_norm_ref(x, norm.weight, norm.eps), rtol=0, atol=0)


# ---- GPU (bf16, realistic DSv4-Flash shapes); the lead runs these on an H200 ----

GPU_CASES = [
    ("q_head_norm", (4096, 64, 512), "none"),
    ("hidden", (4096, 4096), "fp32"),
    ("q_latent", (4096, 1024), "fp32"),
    ("kv", (4096, 512), "fp32"),
    ("d7168", (1024, 7168), "fp32"),
    ("bf16_weight", (4096, 4096), "bf16"),
    ("chunked_16384", (256, 16384), "fp32"),
    ("odd_d", (3001, 1000), "fp32"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("name", "shape", "wkind"), GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_bf16_realistic_shapes(name, shape, wkind):
    torch.manual_seed(7)
    x = (2 * torch.randn(shape, device="cuda")).bfloat16()
    _check_against_reference(x, _weight(wkind, shape[-1], "cuda"))


@needs_triton
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_output_can_be_rotated_in_place(backend):
    """The norm's output is a plain tensor (not a view made inside the Function): an in-place RoPE on it (what the
    attention does to the normalised q) works under autograd and gives the out-of-place gradients."""
    from dsv4_primitives import RopeConfig, apply_rope

    cfg = RopeConfig(rope_dim=8, base=10000.0)
    x = torch.randn(6, 3, 16, requires_grad=True)
    w = torch.randn(6, 3, 16)
    pos = torch.arange(6)
    grads = []
    for inplace in (False, True):
        x.grad = None
        y = rms_norm(x, None, 1e-6, backend=backend)  # [6, 3, 16]
        y = apply_rope(y, pos, cfg, inplace=inplace, backend=backend, max_position=5)
        (y * w).sum().backward()
        grads.append((y.detach().clone(), x.grad.clone()))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=0, atol=0)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-6, atol=1e-6)
