"""Atomic-free MoE permute / unpermute (PyTorch path and Triton kernels, the interpreter on CPU) vs megatron-core's
unfused ``permute`` / ``unpermute`` (bit-identical in fp32 on CPU, forward and backward) and vs the fp64 references
(bf16, project tolerance rule): padding rows, empty experts, T = 1, top-1, E not a power of two, odd H, truncated
and over-sized permutations; determinism and bad input; the sort-free index maps (PyTorch path, Triton kernels)
equal to the former two-sort builder entry for entry. GPU: bf16 at dispatcher size, the map kernels."""

import pytest
import torch

from dsv4_testkit import assert_close_to_ref
from hash_moe import build_permute_map, permute, permute_ref, unpermute, unpermute_ref
from hash_moe.kernels.permute_triton import permute_map_triton
from hash_moe.permute import permute_map_torch, sorted_permute_map_ref
from hash_moe.row_gather import gather_rows, gather_sum_rows

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference", "triton"]


def _routing(t, e, k, pad_tokens=(), empty_experts=(), seed=0, device="cpu"):
    """``[T, E]`` bool map: ``k`` distinct experts per token (never an expert in ``empty_experts``), padding rows
    all-False; and ``[T, E]`` probs (zero where not routed)."""
    g = torch.Generator().manual_seed(seed)
    allowed = [x for x in range(e) if x not in empty_experts]
    rm = torch.zeros(t, e, dtype=torch.bool)
    for i in range(t):
        if i not in pad_tokens:
            rm[i, torch.tensor(allowed)[torch.randperm(len(allowed), generator=g)[:k]]] = True
    probs = torch.rand(t, e, generator=g) * rm
    return rm.to(device), probs.to(device)


def _megatron(x, rm, probs, num_out, g_perm, g_probs, g_y):
    """megatron's unfused permute + unpermute: outputs and the gradients of x and probs (fresh leaves)."""
    from megatron.core.transformer.moe.moe_utils import permute as m_permute
    from megatron.core.transformer.moe.moe_utils import unpermute as m_unpermute

    xl, pl = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    x_perm, p_perm, rows, _, _ = m_permute(xl, rm, probs=pl, num_out_tokens=num_out)
    dx, dp = torch.autograd.grad((x_perm * g_perm).sum() + (p_perm * g_probs).sum(), (xl, pl))
    yl = x_perm.detach().clone().requires_grad_()
    y = m_unpermute(yl, rows, restore_shape=x.shape, routing_map=rm)
    (dy_perm,) = torch.autograd.grad(y, yl, g_y)
    return x_perm.detach(), p_perm.detach(), rows, dx, dp, y.detach(), dy_perm


def _ours(x, rm, probs, num_out, g_perm, g_probs, g_y, backend, k=None):
    xl, pl = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    x_perm, p_perm, pmap = permute(xl, rm, pl, num_out, max_routes_per_token=k, backend=backend)
    dx, dp = torch.autograd.grad((x_perm * g_perm).sum() + (p_perm * g_probs).sum(), (xl, pl))
    yl = x_perm.detach().clone().requires_grad_()
    y = unpermute(yl, pmap, x.shape, backend=backend)
    (dy_perm,) = torch.autograd.grad(y, yl, g_y)
    return x_perm.detach(), p_perm.detach(), pmap.token_of_row, dx, dp, y.detach(), dy_perm


CASES = {
    # name: (T, E, K, H, padding tokens, empty experts)
    "basic": (13, 5, 2, 7, (), ()),
    "padding": (11, 6, 3, 33, (0, 4, 10), ()),
    "empty-experts": (9, 7, 2, 16, (3,), (0, 5)),
    "T1": (1, 3, 2, 5, (), ()),
    "top1": (10, 4, 1, 9, (2,), (3,)),
    "all-experts": (6, 3, 3, 8, (1,), ()),
    "all-padding": (4, 5, 2, 6, (0, 1, 2, 3), ()),
}
NAMES = ("x_perm", "probs_perm", "token_of_row", "dx", "dprobs", "y", "dy_perm")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_megatron_bitwise_fp32(case, backend):
    """fp32 on CPU: megatron adds rows sequentially in row order, as the fp32 gather-sums do: bit-identical. (On
    CUDA megatron's sums are atomics in arbitrary order; there the two sums agree to fp32 rounding.)"""
    t, e, k, h, pads, empty = CASES[case]
    rm, probs = _routing(t, e, k, pads, empty, seed=t * e, device=DEV)
    n = int(rm.sum())
    x, g_perm, g_probs, g_y = (torch.randn(*s).to(DEV) for s in ((t, h), (n, h), (n,), (t, h)))
    want = _megatron(x, rm, probs, n, g_perm, g_probs, g_y)
    for kk in (k, None):
        got = _ours(x, rm, probs, n, g_perm, g_probs, g_y, backend, kk)
        for name, a, b in zip(NAMES, got, want):
            assert a.dtype == b.dtype, name
            if DEV == "cuda" and name in ("dx", "y"):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
            else:
                assert torch.equal(a, b), f"{name} (K={kk})"


def _reference(x, rm, probs, num_out, g_perm, g_probs, g_y, dtype):
    xl = x.detach().to(dtype).requires_grad_()
    pl = probs.detach().to(dtype).requires_grad_()
    x_perm, p_perm = permute_ref(xl, rm, pl, num_out)
    dx, dp = torch.autograd.grad(
        (x_perm * g_perm.to(dtype)).sum() + (p_perm * g_probs.to(dtype)).sum(), (xl, pl)
    )
    yl = x_perm.detach().clone().requires_grad_()
    y = unpermute_ref(yl, rm)
    (dy_perm,) = torch.autograd.grad(y, yl, g_y.to(dtype))
    return x_perm.detach(), p_perm.detach(), None, dx, dp, y.detach(), dy_perm


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["padding", "empty-experts", "T1", "top1"])
def test_bf16_matches_fp64_reference(case, backend):
    t, e, k, h, pads, empty = CASES[case]
    rm, probs = _routing(t, e, k, pads, empty, seed=7, device=DEV)
    n = int(rm.sum())
    x, g_perm, g_probs, g_y = (torch.randn(*s).to(DEV) for s in ((t, h), (n, h), (n,), (t, h)))
    x, g_perm, g_y = x.bfloat16(), g_perm.bfloat16(), g_y.bfloat16()
    got = _ours(x, rm, probs, n, g_perm, g_probs, g_y, backend, k)
    ref = _reference(x, rm, probs, n, g_perm, g_probs, g_y, torch.float64)
    same = _reference(x, rm, probs, n, g_perm, g_probs, g_y, torch.bfloat16)
    for name, a, r, s in zip(NAMES, got, ref, same):
        if name == "token_of_row":
            continue
        assert a.dtype == (torch.float32 if name == "dprobs" or name == "probs_perm" else torch.bfloat16)
        assert_close_to_ref(name, a, r, s if a.dtype == torch.bfloat16 else None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("extra", [-5, 0, 4])
def test_num_out_truncates_or_leaves_empty_rows(backend, extra):
    """Fewer rows than routed pairs drop the last pairs (megatron's truncation); more leave zero rows at the end."""
    rm, probs = _routing(8, 4, 2, pad_tokens=(6,), seed=3, device=DEV)
    x = torch.randn(8, 5, dtype=torch.float64).to(DEV).requires_grad_()
    p = probs.double().requires_grad_()
    n = int(rm.sum()) + extra
    x_perm, p_perm, pmap = permute(x, rm, p, n, max_routes_per_token=2, backend=backend)
    r_perm, rp_perm = permute_ref(x, rm, p, n)
    assert torch.equal(x_perm, r_perm) and torch.equal(p_perm, rp_perm)
    assert int((pmap.token_of_row < 0).sum()) == max(extra, 0)
    g, gp = torch.randn_like(x_perm), torch.randn_like(p_perm)
    got = torch.autograd.grad((x_perm * g).sum() + (p_perm * gp).sum(), (x, p))
    want = torch.autograd.grad((r_perm * g).sum() + (rp_perm * gp).sum(), (x, p))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-15)
    y = unpermute(x_perm, pmap, backend=backend)
    torch.testing.assert_close(y, unpermute_ref(x_perm, rm), rtol=0, atol=1e-15)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_is_deterministic_and_backends_agree(backend):
    rm, probs = _routing(17, 6, 3, pad_tokens=(2, 9), seed=5, device=DEV)
    x = torch.randn(17, 24).bfloat16().to(DEV)

    def grads(be):
        xl, pl = x.clone().requires_grad_(), probs.clone().requires_grad_()
        x_perm, p_perm, pmap = permute(xl, rm, pl, max_routes_per_token=3, backend=be)
        y = unpermute(x_perm * 3, pmap, backend=be)
        return (y, *torch.autograd.grad((y.float() ** 2).sum() + p_perm.sum(), (xl, pl)))

    first, second, other = grads(backend), grads(backend), grads("reference")
    for a, b, c in zip(first, second, other):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_permute_map_layout():
    rm = torch.tensor([[0, 1, 1], [0, 0, 0], [1, 0, 1]], dtype=torch.bool)
    pmap = build_permute_map(rm, max_routes_per_token=2)
    # rows: expert 0 <- token 2; expert 1 <- token 0; expert 2 <- tokens 0, 2
    assert pmap.token_of_row.tolist() == [2, 0, 0, 2]
    assert pmap.pair_of_row.tolist() == [6, 1, 2, 8]
    assert pmap.rows_of_token.tolist() == [[1, 2], [-1, -1], [0, 3]]
    assert pmap.row_of_pair.tolist() == [[-1, 1, 2], [-1, -1, -1], [0, -1, 3]]
    assert (pmap.num_rows, pmap.num_tokens, pmap.num_experts) == (4, 3, 3)


def _random_maps(seed):
    """``(routing_map, K)`` pairs: top-k maps with padding rows and empty experts, T = 1, E = 1, top-1, all-padding,
    and dense Bernoulli maps (rows of up to E entries)."""
    g = torch.Generator().manual_seed(seed)
    maps = []
    for t, e, k, pads, empty in [
        (13, 5, 2, (0, 7), (3,)),
        (1, 4, 2, (), ()),
        (9, 1, 1, (4,), ()),
        (11, 6, 1, (2, 3), (0, 5)),
        (6, 3, 3, (), ()),
        (5, 4, 2, (0, 1, 2, 3, 4), ()),
        (1, 1, 1, (), ()),
    ]:
        maps.append((_routing(t, e, k, pads, empty, seed=seed + t * e)[0], k))
    for t, e in [(17, 7), (4, 9), (1, 3)]:
        maps.append((torch.rand(t, e, generator=g) < 0.4, e))
    return maps


def _assert_maps_equal(got, want, what):
    for name, a, b in zip(("token_of_row", "pair_of_row", "row_of_pair", "rows_of_token"), got, want):
        assert a.dtype == torch.int64 and a.shape == b.shape and torch.equal(a, b), (
            f"{what}: {name}\n{a}\n{b}"
        )
        assert a.is_contiguous(), f"{what}: {name} not contiguous"


def _num_outs(rm):
    n = int(rm.sum())
    return sorted({n, max(n - 3, 0), n // 2, 0, n + 4, rm.numel() + 2})


@pytest.mark.parametrize("backend", BACKENDS)
def test_sort_free_map_equals_sorted_map(backend):
    """The sort-free map (PyTorch scatters; Triton's two kernels) equals the two-sort map entry for entry: every
    num_out (truncating, exact, extending past T * E, 0) and K (the router's, E), padding rows, empty experts."""
    for rm, k in _random_maps(seed=11):
        t, e = rm.shape
        for num_out in _num_outs(rm):
            for kk in {k, e}:
                want = sorted_permute_map_ref(rm, num_out, kk)
                got = build_permute_map(rm.to(DEV), num_out, max_routes_per_token=kk, backend=backend)
                got = (got.token_of_row, got.pair_of_row, got.row_of_pair, got.rows_of_token)
                _assert_maps_equal([a.cpu() for a in got], want, f"T={t} E={e} K={kk} num_out={num_out}")


def test_triton_map_multi_program_tiling():
    """Many programs, several tiles per program, tiles of 1 token: the count table, the per-expert carry over a
    program's tiles and the empty-row shares; rows with more than K routed pairs keep their first K (the CUDA
    behaviour, where the ValueError check is skipped)."""
    g = torch.Generator().manual_seed(3)
    rm = torch.rand(23, 6, generator=g) < 0.5
    rm[[4, 5, 17]] = False
    rm[:, 2] = False
    n = int(rm.sum())
    for num_out in (n, n - 7, n + 30):
        for k in (2, 6):
            want = sorted_permute_map_ref(rm, num_out, k)
            for block_t, progs in ((1, 4), (2, 3), (4, 100), (8, 1)):
                got = permute_map_triton(rm.to(DEV), num_out, k, block_t=block_t, num_programs=progs)
                _assert_maps_equal(
                    [a.cpu() for a in got], want, f"K={k} num_out={num_out} tiles {block_t}x{progs}"
                )
            if k < 6:
                assert torch.equal(permute_map_torch(rm, num_out, k)[3], want[3])


def test_map_empty_shapes_and_rows_check():
    """T = 0, E = 0 and E > 2048 (PyTorch path on every backend) equal the sorted map; the CPU ValueError counts
    the pairs kept inside num_out, as before."""
    for shape, k in (((0, 3), 2), ((4, 0), 1), ((0, 0), 1)):
        rm = torch.zeros(shape, dtype=torch.bool)
        for num_out in (0, 3):
            for backend in BACKENDS:
                got = build_permute_map(rm, num_out, max_routes_per_token=k, backend=backend)
                got = (got.token_of_row, got.pair_of_row, got.row_of_pair, got.rows_of_token)
                _assert_maps_equal(got, sorted_permute_map_ref(rm, num_out, min(k, shape[1])), f"{shape}")
    wide = torch.zeros(2, 2049, dtype=torch.bool)  # wider than the Triton map kernels take: the PyTorch path
    wide[0, [5, 2048]] = wide[1, 7] = True
    got = build_permute_map(wide, 4, max_routes_per_token=2, backend="triton")
    got = (got.token_of_row, got.pair_of_row, got.row_of_pair, got.rows_of_token)
    _assert_maps_equal(got, sorted_permute_map_ref(wide, 4, 2), "E = 2049")
    rm = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # rows: e0 <- t0, t1; e1 <- t0; e2 <- t1
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="more than max_routes_per_token=1"):
            build_permute_map(rm, max_routes_per_token=1, backend=backend)
        # num_out = 2 keeps only expert 0's rows: one pair per token, no error (as the sorted builder)
        pmap = build_permute_map(rm, 2, max_routes_per_token=1, backend=backend)
        assert pmap.rows_of_token.tolist() == [[0], [1]] and pmap.pair_of_row.tolist() == [0, 3]


def test_row_primitives_odd_shapes():
    def t(v, **kw):
        return torch.as_tensor(v, **kw).to(DEV)

    src, zero = t(torch.randn(5, 3)), t(torch.zeros(3))
    for be in BACKENDS:
        want = torch.stack([src[4], zero, src[0], src[0]])
        assert torch.equal(gather_rows(src, t([4, -1, 0, 0]), backend=be), want)
        two = t([[4, 1, -1], [-1, -1, -1]])
        assert torch.equal(gather_sum_rows(src, two, backend=be), torch.stack([src[4] + src[1], zero]))
        assert gather_rows(t(torch.zeros(0, 3)), t([-1, -1]), backend=be).eq(0).all()
        assert gather_rows(src, t([], dtype=torch.long), backend=be).shape == (0, 3)
        strided = t(torch.randn(3, 10))[:, ::2]  # column stride 2: copied to rows first
        assert torch.equal(gather_rows(strided, t([2, 0]), backend=be), strided[[2, 0]])


def test_bad_input():
    rm, probs = _routing(4, 3, 2, seed=1)
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match="bool"):
        permute(x, rm.int(), probs)
    with pytest.raises(ValueError, match="x must be"):
        permute(x[:3], rm, probs)
    with pytest.raises(ValueError, match="probs must be"):
        permute(x, rm, probs[:, :2])
    with pytest.raises(ValueError, match="more than max_routes_per_token=1"):
        permute(x, rm, probs, max_routes_per_token=1)
    with pytest.raises(ValueError, match="max_routes_per_token must be"):
        permute(x, rm, probs, max_routes_per_token=0)
    with pytest.raises(ValueError, match="num_out"):
        permute(x, rm, probs, -1)
    with pytest.raises(ValueError, match="backend"):
        permute(x, rm, probs, backend="cuda")
    x_perm, _, pmap = permute(x, rm, probs)
    with pytest.raises(ValueError, match="R = 8 rows"):
        unpermute(x_perm[:5], pmap)
    with pytest.raises(ValueError, match="restore_shape"):
        unpermute(x_perm, pmap, (4, 3, 2))
    assert unpermute(x_perm, pmap, (2, 2, 6)).shape == (2, 2, 6)


@pytest.mark.gpu
def test_gpu_bf16_dispatch_size_matches_megatron_and_reference():
    """T = 4096 tokens (64 padding), H = 1024, E = 16, top-6: forward rows bit-identical to megatron, unpermute and
    all gradients within the tolerance rule of the fp64 reference, two backward runs bit-identical."""
    torch.manual_seed(0)
    t, e, k, h = 4096, 16, 6, 1024
    scores = torch.rand(t, e, device=DEV)
    rm = torch.zeros(t, e, dtype=torch.bool, device=DEV).scatter_(1, scores.topk(k, dim=1).indices, True)
    rm[-64:] = False
    rm[:, 13] = False  # an empty expert
    probs = torch.rand(t, e, device=DEV) * rm
    x = torch.randn(t, h, device=DEV).bfloat16()
    n = int(rm.sum())
    g_perm = torch.randn(n, h, device=DEV).bfloat16()
    g_probs, g_y = torch.randn(n, device=DEV), torch.randn(t, h, device=DEV).bfloat16()
    got = _ours(x, rm, probs, n, g_perm, g_probs, g_y, "triton", k)
    again = _ours(x, rm, probs, n, g_perm, g_probs, g_y, "triton", k)
    meg = _megatron(x, rm, probs, n, g_perm, g_probs, g_y)
    for i in (0, 1, 2, 6):  # x_perm, probs_perm, rows: pure copies; dy_perm: a gather
        assert torch.equal(got[i], meg[i]), NAMES[i]
    ref = _reference(x, rm, probs, n, g_perm, g_probs, g_y, torch.float64)
    same = _reference(x, rm, probs, n, g_perm, g_probs, g_y, torch.bfloat16)
    for name, a, b, r, s in zip(NAMES, got, again, ref, same):
        assert torch.equal(a, b), f"{name} not deterministic"
        if r is not None:
            assert_close_to_ref(name, a, r, s if a.dtype == torch.bfloat16 else None)
    torch_path = _ours(x, rm, probs, n, g_perm, g_probs, g_y, "reference", k)
    for name, a, b in zip(NAMES, got, torch_path):
        assert torch.equal(a, b), f"{name}: Triton vs PyTorch path"


@pytest.mark.gpu
def test_gpu_map_kernels_match_sorted_map():
    """The two map kernels on the GPU (several tiles per program at E = 256) equal the PyTorch path and the sorted
    map: dispatcher sizes with padding rows and an empty expert, truncated and extended num_out."""
    torch.manual_seed(0)
    for t, e, k in ((4096, 16, 6), (16384, 256, 8), (3001, 7, 2)):
        scores = torch.rand(t, e, device=DEV)
        rm = torch.zeros(t, e, dtype=torch.bool, device=DEV).scatter_(1, scores.topk(k, dim=1).indices, True)
        rm[-(t // 64) :] = False
        rm[:, e // 2] = False
        n = int(rm.sum())
        for num_out in (n, n - 1000, n + 777):
            want = sorted_permute_map_ref(rm, num_out, k)
            got = build_permute_map(rm, num_out, max_routes_per_token=k, backend="triton")
            got = (got.token_of_row, got.pair_of_row, got.row_of_pair, got.rows_of_token)
            _assert_maps_equal(got, want, f"T={t} E={e} num_out={num_out}")
            _assert_maps_equal(
                permute_map_torch(rm, num_out, k), want, f"torch T={t} E={e} num_out={num_out}"
            )
