"""apply_rope (Triton under the interpreter on CPU, eager backend) vs the fp32 reference; oracles R1, R2."""

import pytest
import torch

from dsv4_primitives import (
    RopeConfig,
    YarnConfig,
    apply_rope,
    apply_rope_ref,
    positions_from_cu_seqlens,
    positions_sbhd,
)
from dsv4_testkit import assert_close_to_ref, interpreting

PLAIN = RopeConfig(8, 10000.0)
YARN = RopeConfig(8, 160000.0, YarnConfig(4.0, 32))
BACKENDS = [
    "reference",
    pytest.param(
        "triton", marks=pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 on CPU")
    ),
]
if torch.cuda.is_available():
    BACKENDS = ["reference", "triton"]


def _layouts():
    """(name, x shape, positions) covering SBHD, THD with an empty document, kv without head dim, odd widths."""
    cu = torch.tensor([0, 3, 3, 7, 8])  # documents of 3, 0, 4 and 1 tokens
    return [
        ("sbhd_q", (5, 2, 3, 24), positions_sbhd(5, 2)),
        ("thd_q", (8, 2, 16), positions_from_cu_seqlens(cu)),
        ("thd_kv_no_head_dim", (8, 16), positions_from_cu_seqlens(cu)),
        ("rope_only_D_eq_r", (4, 1, 8), torch.arange(4)),
        ("odd_nope_D13", (3, 2, 13), torch.tensor([0, 5, 2])),
        ("explicit_ids_cp", (6, 3, 40), torch.tensor([100, 101, 7, 8, 196608, 196609])),
        ("negative_positions", (4, 2, 16), torch.tensor([-3, 0, 2, -12345])),
        ("length_one", (1, 1, 2, 16), positions_sbhd(1, 1)),
    ]


LAYOUTS = _layouts()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", [PLAIN, YARN], ids=["plain", "yarn"])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize(("name", "shape", "pos"), LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_forward_backward_matches_reference(backend, cfg, inverse, name, shape, pos):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float32, requires_grad=True)
    gy = torch.randn(shape)
    y = apply_rope(x, pos, cfg, inverse=inverse, backend=backend)
    (gx,) = torch.autograd.grad(y, x, gy)
    xr = x.detach().double().requires_grad_(True)
    yr = apply_rope_ref(xr, pos, cfg, inverse=inverse)
    (gxr,) = torch.autograd.grad(yr, xr, gy.double())
    assert_close_to_ref("y", y, yr)
    assert_close_to_ref("dx", gx, gxr)
    r = cfg.rope_dim
    assert torch.equal(y[..., :-r], x[..., :-r])  # R1 (bit-identical nope channels)
    assert torch.equal(gx[..., :-r], gy[..., :-r])


@pytest.mark.parametrize("backend", BACKENDS)
def test_r1_r2_roundtrip_and_pair_norms(backend):
    torch.manual_seed(1)
    x = torch.randn(7, 3, 512)  # real head width: [448 nope | 64 rope]
    cfg = RopeConfig(64, 160000.0, YarnConfig())
    pos = torch.tensor([0, 1, 127, 4096, 65535, 65536, 196608])
    y = apply_rope(x, pos, cfg, backend=backend)
    assert torch.equal(y[..., :448], x[..., :448])  # R1
    back = apply_rope(y, -pos, cfg, backend=backend)
    torch.testing.assert_close(back, x, rtol=0, atol=2e-5)  # R2: RoPE(RoPE(x, p), -p) == x
    back_inv = apply_rope(y, pos, cfg, inverse=True, backend=backend)
    torch.testing.assert_close(back_inv, back, rtol=0, atol=1e-6)  # inverse=True is rotation by -p
    pair = lambda t: t[..., 448:].reshape(7, 3, 32, 2).norm(dim=-1)
    torch.testing.assert_close(pair(y), pair(x), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_forward_and_autograd(backend):
    torch.manual_seed(2)
    pos = positions_sbhd(4, 2)
    w = torch.randn(4, 2, 3, 16, requires_grad=True)
    h = w * 2.0  # non-leaf: in place is allowed
    h_id = h.data_ptr()
    out = apply_rope(h, pos, YARN, inplace=True, backend=backend)
    assert out.data_ptr() == h_id and out is h
    ref = apply_rope_ref(w.detach() * 2.0, pos, YARN)
    torch.testing.assert_close(out.detach(), ref, rtol=0, atol=1e-6)
    gy = torch.randn_like(ref)
    (gw,) = torch.autograd.grad(out, w, gy)
    wr = w.detach().clone().requires_grad_(True)
    (gwr,) = torch.autograd.grad(apply_rope_ref(wr * 2.0, pos, YARN), wr, gy)
    torch.testing.assert_close(gw, gwr, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_refused_where_autograd_forbids_it(backend):
    pos = torch.arange(3)
    leaf = torch.randn(3, 2, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        apply_rope(leaf, pos, PLAIN, inplace=True, backend=backend)
    z = torch.randn(3, 2, 16, requires_grad=True)
    o = z.exp()  # exp saves its output for backward
    apply_rope(o, pos, PLAIN, inverse=True, inplace=True, backend=backend)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()
    plain = torch.randn(3, 2, 16)  # no grad needed: plain in-place update
    want = apply_rope_ref(plain, pos, PLAIN)
    apply_rope(plain, pos, PLAIN, inplace=True, backend=backend)
    torch.testing.assert_close(plain, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_place_inverse_preserves_saved_output(backend):
    torch.manual_seed(3)
    z = torch.randn(5, 2, 16, requires_grad=True)
    o = z.exp()  # o is saved by exp's backward (like O kept by a fused attention backward)
    o_before, version = o.detach().clone(), o._version
    pos = torch.arange(5)
    y = apply_rope(o, pos, YARN, inverse=True, inplace=False, backend=backend)
    assert torch.equal(o.detach(), o_before) and o._version == version
    gy = torch.randn_like(y)
    (gz,) = torch.autograd.grad(y, z, gy)
    zr = z.detach().double().requires_grad_(True)
    (gzr,) = torch.autograd.grad(apply_rope_ref(zr.exp(), pos, YARN, inverse=True), zr, gy.double())
    assert_close_to_ref("dz", gz, gzr)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inplace", [False, True])
def test_non_contiguous_inputs(backend, inplace):
    torch.manual_seed(4)
    base = torch.randn(3, 4, 2, 16)  # [B, S, H, D] -> transposed view [S, B, H, D]
    x = base.transpose(0, 1)
    pos = positions_sbhd(4, 3)
    want = apply_rope_ref(x, pos, PLAIN)
    y = apply_rope(x, pos, PLAIN, inplace=inplace, backend=backend)
    torch.testing.assert_close(y, want, rtol=0, atol=1e-6)
    if inplace:
        torch.testing.assert_close(base.transpose(0, 1), want, rtol=0, atol=1e-6)
    channel_strided = torch.randn(5, 2, 32)[..., ::2]  # channel stride 2
    want2 = apply_rope_ref(channel_strided, torch.arange(5), PLAIN)
    y2 = apply_rope(channel_strided, torch.arange(5), PLAIN, inplace=inplace, backend=backend)
    torch.testing.assert_close(y2, want2, rtol=0, atol=1e-6)
    if inplace:
        torch.testing.assert_close(channel_strided, want2, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_matches_reference_within_rule(backend):
    torch.manual_seed(5)
    x = torch.randn(6, 3, 24).bfloat16().requires_grad_(True)
    pos = torch.tensor([0, 3, 9, 1000, 70000, 5])
    gy = torch.randn(6, 3, 24).bfloat16()
    y = apply_rope(x, pos, YARN, backend=backend)
    (gx,) = torch.autograd.grad(y, x, gy)
    xr = x.detach().float().requires_grad_(True)
    yr = apply_rope_ref(xr, pos, YARN)
    (gxr,) = torch.autograd.grad(yr, xr, gy.float())
    xs = x.detach().clone().requires_grad_(True)
    ys = apply_rope_ref(xs, pos, YARN)  # plain PyTorch in bf16 (fp32 math, bf16 storage)
    (gxs,) = torch.autograd.grad(ys, xs, gy)
    assert y.dtype == torch.bfloat16 and gx.dtype == torch.bfloat16
    assert_close_to_ref("y", y, yr, ys)
    assert_close_to_ref("dx", gx, gxr, gxs)


def test_empty_and_max_position_hint():
    x = torch.randn(0, 2, 16)
    assert apply_rope(x, torch.zeros(0, dtype=torch.long), PLAIN).shape == (0, 2, 16)
    x = torch.randn(3, 2, 16)
    pos = torch.tensor([1, 2, 3])
    y = apply_rope(x, pos, PLAIN, max_position=100)
    torch.testing.assert_close(y, apply_rope_ref(x, pos, PLAIN), rtol=0, atol=1e-6)


def test_bad_inputs_raise_value_error():
    x = torch.randn(4, 2, 16)
    with pytest.raises(ValueError, match="prefix"):
        apply_rope(x, torch.arange(3), PLAIN)
    with pytest.raises(ValueError, match="integer"):
        apply_rope(x, torch.arange(4).float(), PLAIN)
    with pytest.raises(ValueError, match="backend"):
        apply_rope(x, torch.arange(4), PLAIN, backend="cuda")
    with pytest.raises(ValueError, match="rope_dim"):
        apply_rope(torch.randn(4, 2, 6), torch.arange(4), PLAIN)
    with pytest.raises(ValueError, match="floating"):
        apply_rope(torch.ones(4, 2, 16, dtype=torch.long), torch.arange(4), PLAIN)
    with pytest.raises(ValueError, match="RopeConfig"):
        apply_rope(x, torch.arange(4), {"rope_dim": 8})


@pytest.mark.gpu
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_gpu_bf16_triton_q_kv_shapes(inverse, inplace):
    torch.manual_seed(6)
    cfg = RopeConfig(64, 160000.0, YarnConfig())
    cu = torch.tensor([0, 1000, 1000, 3000, 4096], device="cuda")
    pos = positions_from_cu_seqlens(cu)
    for shape in [(4096, 64, 512), (4096, 512), (4096, 1, 512)]:
        x = torch.randn(shape, device="cuda").bfloat16()
        gy = torch.randn(shape, device="cuda").bfloat16()
        xr = x.float().requires_grad_(True)
        yr = apply_rope_ref(xr, pos, cfg, inverse=inverse)
        (gxr,) = torch.autograd.grad(yr, xr, gy.float())
        xs = x.clone().requires_grad_(True)
        ys = apply_rope_ref(xs, pos, cfg, inverse=inverse)
        (gxs,) = torch.autograd.grad(ys, xs, gy)
        leaf = x.clone().requires_grad_(True)
        xt = leaf * 1 if inplace else leaf  # in place needs a non-leaf
        y = apply_rope(xt, pos, cfg, inverse=inverse, inplace=inplace, backend="triton")
        assert torch.equal(y[..., :448].detach(), x[..., :448])
        assert_close_to_ref("y", y, yr, ys)
        (gx,) = torch.autograd.grad(y, leaf, gy)
        assert_close_to_ref("dx", gx, gxr, gxs)


@pytest.mark.parametrize("inverse", [False, True])
def test_reference_computes_in_fp64_for_fp64_input(inverse):
    """fp64 in -> fp64 math (callers gradcheck through the reference); fp32 and bf16 inputs compute in fp32."""
    torch.manual_seed(3)
    x = torch.randn(5, 2, 12, dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([0, 1, 7, -3, 1000])
    y = apply_rope_ref(x, pos, YARN, inverse=inverse)
    assert y.dtype == torch.float64
    y32 = apply_rope_ref(x.detach().float(), pos, YARN, inverse=inverse)
    assert 0 < (y.detach() - y32.double()).abs().max() < 1e-5  # fp64 math is not fp32 math cast up
    assert torch.autograd.gradcheck(lambda t: apply_rope_ref(t, pos, YARN, inverse=inverse), [x])
    assert apply_rope_ref(x.detach().bfloat16(), pos, YARN).dtype == torch.bfloat16


def test_backend_env_var_overrides_auto(monkeypatch):
    ENV_VAR = "DSV4_PRIMITIVES_BACKEND"
    x, pos = torch.randn(3, 2, 16), torch.arange(3)
    monkeypatch.setenv(ENV_VAR, "bogus")
    with pytest.raises(ValueError, match=ENV_VAR):
        apply_rope(x, pos, PLAIN)
    monkeypatch.setenv(ENV_VAR, "reference")
    torch.testing.assert_close(apply_rope(x, pos, PLAIN), apply_rope_ref(x, pos, PLAIN), rtol=0, atol=1e-6)
    monkeypatch.setenv(ENV_VAR, "triton")
    if interpreting():
        torch.testing.assert_close(
            apply_rope(x, pos, PLAIN), apply_rope_ref(x, pos, PLAIN), rtol=0, atol=1e-6
        )
    elif not torch.cuda.is_available():
        with pytest.raises(ValueError, match=f"{ENV_VAR}=triton"):
            apply_rope(x, pos, PLAIN)
