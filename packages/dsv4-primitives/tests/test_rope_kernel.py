"""The fused RoPE kernel's tiling: [positions, heads] tiles, edge masks, fused nope copy, odd widths, alignment.

On CPU the Triton interpreter normally runs one big program per call; these tests shrink the interpreter's tile
(``INTERPRET_CONFIG``) so that the CUDA-style multi-program grid (several programs along positions AND heads, masked
edge tiles) is exercised, then compare with the fp32 reference (forward and gradient, 2x rule), check the nope
channels bit for bit and the in-place result against the out-of-place one.
"""

import pytest
import torch

from dsv4_primitives import RopeConfig, YarnConfig, apply_rope, apply_rope_ref
from dsv4_primitives.rope import apply as rope_apply
from dsv4_primitives.rope.apply import RopeKernelConfig, launch_params
from dsv4_testkit import assert_close_to_ref, interpreting

needs_triton = pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="needs TRITON_INTERPRET=1 or CUDA"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton 3.6's interpreter casts fp32 -> bf16 by truncation (GPUs round to nearest even), which can double the
# rounding error of a bf16 store; fp16 casts round correctly there, so the 16-bit case on CPU is fp16.
LOW = torch.bfloat16 if torch.cuda.is_available() else torch.float16

R8 = RopeConfig(8, 10000.0)
R6 = RopeConfig(6, 10000.0)  # rope_dim not a power of two (BLOCK_ROPE 8, 3 pairs)
R24 = RopeConfig(24, 160000.0, YarnConfig(4.0, 32))  # 12 pairs, YaRN

# (name, cfg, x shape [N, *H, D], positions)
CASES = [
    ("odd_heads_H5", R8, (7, 5, 40), torch.tensor([0, 1, 2, 3, 900, 5, 6])),
    ("rope6_nope10", R6, (5, 3, 16), torch.tensor([4, 0, 3, 2, 1])),
    ("rope24_only_D_eq_r", R24, (6, 3, 24), torch.tensor([0, 7, 70000, 3, 2, 1])),
    ("T1_H7_odd_nope5", R8, (1, 7, 13), torch.tensor([11])),
    ("negative_positions", R24, (4, 2, 56), torch.tensor([-3, 0, 2, -12345])),
    ("kv_no_head_dim", R8, (9, 24), torch.arange(9) - 2),
    ("heads20_shared_tiles", R8, (3, 20, 24), torch.tensor([2, -1, 40])),
    ("rope2_H17", RopeConfig(2, 10000.0), (3, 17, 6), torch.tensor([0, 5, -7])),  # one pair, 17 heads
]


@pytest.fixture(params=[96, 512], ids=["tiles96B", "tiles512B"])
def small_tiles(request, monkeypatch):
    """Interpreter tiles of 1-16 rows: several programs along positions and heads, masked edge tiles."""
    cfg = RopeKernelConfig(bytes_per_program=request.param, min_programs=1, num_warps=1)
    monkeypatch.setattr(rope_apply, "INTERPRET_CONFIG", cfg)


def test_launch_geometry():
    """Tiles the CUDA launcher picks (bf16 unless noted): [BLOCK_P positions, BLOCK_H heads], grid, warps."""

    def geo(n, h, d, r, elt, copy_nope, cuda=True):
        grid, c, warps = launch_params(n, h, d, r, elt, copy_nope, cuda)
        return (c["BLOCK_P"], c["BLOCK_H"]), grid, warps

    # DSv4 q [8192, 64, 512]: in place 2 positions x 64 heads x 128 B rope slices; out of place 16 rows x 1 KiB
    assert geo(8192, 64, 512, 64, 2, False) == ((2, 64), (4096, 1), 4)
    assert geo(8192, 64, 512, 64, 2, True) == ((1, 16), (8192, 4), 4)
    assert geo(8192, 64, 512, 64, 4, False) == ((1, 64), (8192, 1), 4)  # fp32 in place
    # kv [65536, 512]: one head; 128 rope rows would give 512 programs < min_programs -> 64 rows
    assert geo(65536, 1, 512, 64, 2, False) == ((64, 1), (1024, 1), 4)
    assert geo(65536, 1, 512, 64, 2, True) == ((16, 1), (4096, 1), 4)
    assert geo(65536, 1, 512, 64, 4, False) == ((8, 1), (8192, 1), 4)  # fp32, one head: capped layout rule
    assert geo(1, 64, 512, 64, 2, True) == ((1, 1), (1, 64), 4)  # one token: one row per program
    # few heads: one head per program (8 positions: 12288 rows / 16 would give < min_programs programs)
    assert geo(4096, 3, 512, 64, 2, True) == ((8, 1), (512, 3), 4)
    assert geo(4096, 3, 24, 24, 2, False) == ((8, 1), (512, 3), 4)
    assert geo(8192, 64, 128, 64, 2, True) == ((1, 64), (8192, 1), 4)  # indexer-like q: 64 heads x 128
    # the interpreter: few, large programs
    assert geo(7, 20, 24, 8, 4, True, cuda=False) == ((8, 32), (1, 1), 1)
    with pytest.raises(ValueError, match="positive"):
        RopeKernelConfig(num_warps=0)


@needs_triton
@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=["fp32", "16bit"])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize(("name", "cfg", "shape", "pos"), CASES, ids=[c[0] for c in CASES])
def test_tiled_kernel_matches_reference(dtype, inverse, name, cfg, shape, pos):
    torch.manual_seed(0)
    pos = pos.to(DEVICE)
    x = torch.randn(shape, device=DEVICE).to(dtype).requires_grad_(True)
    gy = torch.randn(shape, device=DEVICE).to(dtype)
    y = apply_rope(x, pos, cfg, inverse=inverse, backend="triton")
    (gx,) = torch.autograd.grad(y, x, gy)
    xr = x.detach().double().requires_grad_(True)
    yr = apply_rope_ref(xr, pos, cfg, inverse=inverse)
    (gxr,) = torch.autograd.grad(yr, xr, gy.double())
    same = None
    gsame = None
    if dtype != torch.float32:
        xs = x.detach().clone().requires_grad_(True)
        ys = apply_rope_ref(xs, pos, cfg, inverse=inverse)
        (gsame,) = torch.autograd.grad(ys, xs, gy)
        same = ys.detach()
    assert y.dtype == dtype and gx.dtype == dtype
    assert_close_to_ref("y", y, yr, same)
    assert_close_to_ref("dx", gx, gxr, gsame)
    r = cfg.rope_dim
    assert torch.equal(y[..., :-r], x[..., :-r])
    assert torch.equal(gx[..., :-r], gy[..., :-r])
    xi = x.detach().clone()
    out = apply_rope(xi, pos, cfg, inverse=inverse, inplace=True, backend="triton")
    assert out is xi
    assert torch.equal(
        xi, y.detach()
    )  # same math in place (rope channels only) and out of place (fused copy)


@needs_triton
@pytest.mark.parametrize("tiles", ["default", "small"])
@pytest.mark.parametrize("inplace", [False, True])
def test_nope_channels_copied_bit_for_bit(tiles, inplace, monkeypatch):
    """nan/inf/-0.0 and subnormals in the nope channels pass through untouched (never converted or multiplied)."""
    if tiles == "small":
        monkeypatch.setattr(rope_apply, "INTERPRET_CONFIG", RopeKernelConfig(64, 1, 1))
    torch.manual_seed(1)
    x = torch.randn(6, 3, 40, device=DEVICE).bfloat16()
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40], device=DEVICE)
    x[..., :5] = special.bfloat16()
    x[2, 1, 7] = float("nan")
    x_bits = x.view(torch.int16).clone()
    pos = torch.tensor([0, 3, -2, 9, 1, 4], device=DEVICE)
    want = apply_rope_ref(x.float(), pos, R8)  # the rope channels are finite
    y = apply_rope(x, pos, R8, inplace=inplace, backend="triton")
    assert torch.equal(y[..., :32].view(torch.int16), x_bits[..., :32])
    torch.testing.assert_close(y[..., 32:].float(), want[..., 32:].float(), rtol=1e-2, atol=1e-2)
    if not inplace:
        assert torch.equal(x.view(torch.int16), x_bits)  # input untouched


@needs_triton
@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize("inplace", [False, True])
def test_strided_head_views_run_without_copy(inplace):
    """[N, H, D] views with head/position strides != D and a misaligned start (no 16-byte vectors) stay exact."""
    torch.manual_seed(2)
    base = torch.randn(5, 4, 51, device=DEVICE)  # heads 51 wide, we use channels [3, 43)
    x = base[..., 3:43]  # [5, 4, 40]: viewable as [N, H, D] with stride_h = 51, stride_n = 204
    pos = torch.tensor([0, 1, 2, 3, 50], device=DEVICE)
    want = apply_rope_ref(x, pos, R8, inverse=True)
    y = apply_rope(x, pos, R8, inverse=True, inplace=inplace, backend="triton")
    torch.testing.assert_close(y, want, rtol=0, atol=1e-6)
    if inplace:
        assert y.data_ptr() == x.data_ptr()
        torch.testing.assert_close(base[..., 3:43], want, rtol=0, atol=1e-6)
    assert torch.equal(y[..., :32], want[..., :32])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
@pytest.mark.parametrize("inverse", [False, True])
def test_gpu_odd_shapes(dtype, inverse):
    """CUDA geometry (default KERNEL_CONFIG) on odd heads, rope widths, D == r, T = 1, negatives, strided views."""
    torch.manual_seed(7)
    dsv4 = RopeConfig(64, 160000.0, YarnConfig())
    cases = [*CASES, ("q_T1", dsv4, (1, 64, 512), torch.tensor([5])), ("q_H3", dsv4, (37, 3, 512), None)]
    for name, cfg, shape, pos in cases:
        pos = (torch.arange(shape[0]) * 977 - 300 if pos is None else pos).cuda()
        x = torch.randn(shape, device="cuda").to(dtype)
        gy = torch.randn(shape, device="cuda").to(dtype)
        xr = x.float().requires_grad_(True)
        yr = apply_rope_ref(xr, pos, cfg, inverse=inverse)
        (gxr,) = torch.autograd.grad(yr, xr, gy.float())
        xs = x.clone().requires_grad_(True)
        ys = apply_rope_ref(xs, pos, cfg, inverse=inverse)
        (gxs,) = torch.autograd.grad(ys, xs, gy)
        xl = x.clone().requires_grad_(True)
        y = apply_rope(xl, pos, cfg, inverse=inverse, backend="triton")
        (gx,) = torch.autograd.grad(y, xl, gy)
        r = cfg.rope_dim
        assert torch.equal(y[..., :-r].detach(), x[..., :-r]), name
        assert_close_to_ref(f"{name} y", y, yr, None if dtype == torch.float32 else ys)
        assert_close_to_ref(f"{name} dx", gx, gxr, None if dtype == torch.float32 else gxs)
        xi = x.clone()
        apply_rope(xi, pos, cfg, inverse=inverse, inplace=True, backend="triton")
        assert torch.equal(xi, y.detach()), name
        wide = torch.randn(shape[0], 2, shape[-1] + 8, device="cuda").to(dtype)  # strided heads, aligned
        xv = wide[..., 8:]
        torch.testing.assert_close(
            apply_rope(xv, pos, cfg, inverse=inverse, backend="triton"),
            apply_rope(xv.contiguous(), pos, cfg, inverse=inverse, backend="triton"),
            rtol=0,
            atol=0,
        )
