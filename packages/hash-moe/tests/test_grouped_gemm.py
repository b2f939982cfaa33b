"""Grouped expert GEMMs: torch._grouped_mm and the loop agree (forward and backward); experts vs reference."""

import pytest
import torch

from dsv4_testkit import assert_close_to_ref
from hash_moe import grouped_mm, grouped_swiglu_experts, swiglu_mlp
from hash_moe.grouped_gemm import resolve_backend
from hash_moe.reference import _expert


def _ref_grouped(x, w, counts):
    out, o = [], 0
    for g, c in enumerate(counts):
        out.append(x[o : o + c] @ w[g].t())
        o += c
    return torch.cat(out)


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
@pytest.mark.parametrize("counts", [[3, 0, 4, 1], [0, 0, 0, 5], [0, 0, 0, 0], [1]])
def test_grouped_mm_fwd_bwd_match_reference(backend, counts):
    torch.manual_seed(sum(counts) + len(counts))
    x = torch.randn(sum(counts), 8, requires_grad=True)
    w = torch.randn(len(counts), 16, 8, requires_grad=True)
    out = grouped_mm(x, w, torch.tensor(counts), backend=backend)
    g = torch.randn_like(out)
    gx, gw = torch.autograd.grad((out * g).sum(), (x, w))
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = _ref_grouped(x64, w64, counts)
    rx, rw = torch.autograd.grad((ref * g.double()).sum(), (x64, w64))
    assert_close_to_ref("out", out, ref)
    assert_close_to_ref("dx", gx, rx)
    assert_close_to_ref("dw", gw, rw)


def test_backends_agree_on_cpu_fp32():
    torch.manual_seed(0)
    counts = [5, 0, 9, 2]
    x = torch.randn(16, 24)
    w = torch.randn(4, 32, 24)
    torch.testing.assert_close(
        grouped_mm(x, w, counts, backend="loop"), grouped_mm(x, w, counts, backend="grouped_mm")
    )
    assert resolve_backend("auto", x, w) == "loop"  # CPU


def test_bad_counts():
    with pytest.raises(ValueError, match="sum"):
        grouped_mm(torch.zeros(3, 4), torch.zeros(2, 5, 4), [1, 1])
    with pytest.raises(ValueError, match="groups"):
        grouped_mm(torch.zeros(3, 4), torch.zeros(2, 5, 4), [3])
    with pytest.raises(ValueError, match="K"):
        grouped_mm(torch.zeros(3, 4), torch.zeros(2, 5, 3), [1, 2])
    with pytest.raises(ValueError, match="backend"):
        grouped_mm(torch.zeros(3, 4), torch.zeros(2, 5, 4), [1, 2], backend="cutlass")
    with pytest.raises(ValueError, match="aligned"):
        grouped_mm(torch.zeros(3, 4), torch.zeros(2, 5, 4), [1, 2], backend="grouped_mm")
    with pytest.raises(ValueError, match="fp32/bf16"):
        grouped_mm(torch.zeros(3, 4).double(), torch.zeros(2, 4, 4).double(), [1, 2], backend="grouped_mm")


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_grouped_experts_match_per_token_reference(backend):
    torch.manual_seed(1)
    counts = [4, 0, 3]
    x = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    gu = (torch.randn(3, 8, 8, dtype=torch.float64) * 0.5).requires_grad_()
    dn = (torch.randn(3, 8, 4, dtype=torch.float64) * 0.5).requires_grad_()
    p = torch.rand(7, dtype=torch.float64, requires_grad=True)
    # torch._grouped_mm has no fp64: run it in fp32 against the fp64 reference
    dt = torch.float64 if backend == "loop" else torch.float32
    atol = 1e-12 if backend == "loop" else None
    leaves = [t.detach().to(dt).requires_grad_() for t in (x, gu, dn, p)]
    out = grouped_swiglu_experts(
        leaves[0], counts, leaves[1], leaves[2], limit=0.5, probs=leaves[3], backend=backend
    )
    rows, o = [], 0
    for e, c in enumerate(counts):
        for t in range(o, o + c):
            rows.append(p[t] * _expert(x[t], gu[e], dn[e], 0.5))
        o += c
    ref = torch.stack(rows)
    assert_close_to_ref("out", out, ref, atol=atol)
    g = torch.randn_like(ref)
    got = torch.autograd.grad((out * g.to(dt)).sum(), leaves)
    want = torch.autograd.grad((ref * g).sum(), (x, gu, dn, p))
    for name, a, b in zip(("dx", "dgate_up", "ddown", "dprobs"), got, want):
        assert_close_to_ref(name, a, b, atol=atol)


def test_shared_expert_mlp_is_clamped():
    torch.manual_seed(2)
    x = torch.randn(5, 8, dtype=torch.float64) * 4
    gu = torch.randn(12, 8, dtype=torch.float64)
    dn = torch.randn(8, 6, dtype=torch.float64)
    got = swiglu_mlp(x, gu, dn, limit=0.5)
    want = torch.stack([_expert(x[t], gu, dn, 0.5) for t in range(5)])
    torch.testing.assert_close(got, want)
    assert not torch.allclose(swiglu_mlp(x, gu, dn, limit=None), want)


@pytest.mark.gpu
@pytest.mark.parametrize("counts", [[96, 128, 0, 513, 7, 256], [0] * 6])
def test_grouped_mm_torch_bf16_on_gpu(counts):
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(sum(counts), 256, device=dev)
    w = torch.randn(6, 128, 256, device=dev) / 16
    g = torch.randn(sum(counts), 128, device=dev)
    xb, wb = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    assert resolve_backend("auto", xb, wb) == "grouped_mm"
    out = grouped_mm(xb, wb, counts)
    gx, gw = torch.autograd.grad((out.float() * g).sum(), (xb, wb))
    x32, w32 = x.requires_grad_(), w.requires_grad_()
    ref = grouped_mm(x32, w32, counts, backend="loop")
    rx, rw = torch.autograd.grad((ref * g).sum(), (x32, w32))
    xl, wl = x.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    same = grouped_mm(xl, wl, counts, backend="loop")
    sx, sw = torch.autograd.grad((same.float() * g).sum(), (xl, wl))
    assert_close_to_ref("out", out, ref, same)
    assert_close_to_ref("dx", gx, rx, sx)
    assert_close_to_ref("dw", gw, rw, sw)


def _aligned_with_index_ops(x, w, counts):
    """hash-moe 0.2's padding: index_copy into zeros, index_select back (atomic index_add_ in the backward)."""
    align = 16 // x.element_size()
    padded = [-(-c // align) * align for c in counts]
    cnt, pad = torch.tensor(counts, device=x.device), torch.tensor(padded, device=x.device)
    shift = (pad.cumsum(0) - pad) - (cnt.cumsum(0) - cnt)
    rows = torch.arange(x.shape[0], device=x.device) + torch.repeat_interleave(shift, cnt)
    xp = x.new_zeros(sum(padded), x.shape[1]).index_copy(0, rows, x)
    offs = pad.cumsum(0).to(torch.int32)
    return torch._grouped_mm(xp, w.transpose(-2, -1), offs=offs).index_select(0, rows)


def _graph_nodes(t):
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        todo.extend(f for f, _ in fn.next_functions)
    return {type(f).__name__ for f in seen}


def _check_padding_bit_identical(counts, dev, dt):
    from hash_moe.grouped_gemm import _grouped_mm_aligned

    torch.manual_seed(len(counts))
    x = torch.randn(sum(counts), 32, device=dev).to(dt)
    w = (torch.randn(len(counts), 64, 32, device=dev) / 4).to(dt)
    g = torch.randn(sum(counts), 64, device=dev).to(dt)
    results = []
    for fn in (_grouped_mm_aligned, _aligned_with_index_ops):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xl, wl, counts)
        results.append((out.detach(), *torch.autograd.grad(out, (xl, wl), g)))
        if fn is _grouped_mm_aligned and sum(counts):
            nodes = _graph_nodes(out)
            assert not any("IndexSelect" in n or "IndexCopy" in n for n in nodes), nodes
    for name, a, b in zip(("out", "dx", "dw"), *results):
        assert torch.equal(a, b), name


PADDED_COUNTS = [[3, 0, 5, 1], [1], [4, 8, 2], [0, 7, 0], [9, 17, 0, 30]]


@pytest.mark.parametrize("counts", PADDED_COUNTS)
def test_alignment_padding_is_gathers_and_bit_identical(counts):
    """The padded grouped GEMM gives exactly the old index_copy / index_select results (forward and both gradients)
    and its graph holds no index_select / index_copy node (their backward scatters). CPU: fp32 (4-row alignment)."""
    _check_padding_bit_identical(counts, "cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("counts", PADDED_COUNTS)
def test_alignment_padding_bit_identical_bf16_on_gpu(counts):
    """bf16 on CUDA (8-row alignment, the Triton row gathers)."""
    _check_padding_bit_identical(counts, "cuda", torch.bfloat16)


def _check_device_counts_bit_identical(counts, dev, dt):
    """Counts as a device tensor (no host sync, static worst-case buffer) give exactly the host-count results."""
    from hash_moe.grouped_gemm import _grouped_mm_aligned, grouped_mm_device_counts

    torch.manual_seed(len(counts) + 1)
    x = torch.randn(sum(counts), 32, device=dev).to(dt)
    w = (torch.randn(len(counts), 64, 32, device=dev) / 4).to(dt)
    g = torch.randn(sum(counts), 64, device=dev).to(dt)
    results = []
    for fn, c in (
        (_grouped_mm_aligned, counts),
        (grouped_mm_device_counts, torch.tensor(counts, device=dev)),
    ):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xl, wl, c)
        assert out.shape == (sum(counts), 64)
        results.append((out.detach(), *torch.autograd.grad(out, (xl, wl), g)))
    for name, a, b in zip(("out", "dx", "dw"), *results):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("counts", PADDED_COUNTS + [[8, 4, 12], [0, 0]])
def test_device_counts_bit_identical_to_host_counts(counts):
    """CPU fp32 (4-row alignment): includes all-aligned counts and an empty input (every group empty)."""
    _check_device_counts_bit_identical(counts, "cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("counts", PADDED_COUNTS + [[8, 16, 24], [0, 0]])
def test_device_counts_bit_identical_and_sync_free_on_gpu(counts):
    """bf16 on CUDA: ``grouped_mm`` with CUDA counts takes the device path (bit-identical to the host counts) and
    never synchronises with the host."""
    _check_device_counts_bit_identical(counts, "cuda", torch.bfloat16)
    x = torch.randn(sum(counts), 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(len(counts), 64, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    c = torch.tensor(counts, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = grouped_mm(x, w, c)
        out.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out, grouped_mm(x.detach(), w.detach(), counts))


def test_device_counts_validate_shape_and_dtype():
    from hash_moe.grouped_gemm import grouped_mm_device_counts

    x, w = torch.randn(5, 8), torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="integer"):
        grouped_mm_device_counts(x, w, torch.tensor([2.0, 3.0]))
    with pytest.raises(ValueError, match=r"\[G=2\]"):
        grouped_mm_device_counts(x, w, torch.tensor([5]))


@pytest.mark.parametrize("counts,filler", [([3, 0, 5, 1], 7), ([0, 0], 3), ([4, 8], 1)])
def test_device_counts_filler_rows_are_zero(counts, filler):
    """Device counts summing to less than M: the trailing filler rows give zero output and zero input gradient; the
    routed rows and the weight gradient equal the host-count GEMM of the routed rows alone."""
    from hash_moe.grouped_gemm import _grouped_mm_aligned, grouped_mm_device_counts

    torch.manual_seed(3)
    m = sum(counts)
    x = torch.randn(m + filler, 32)
    w = torch.randn(len(counts), 64, 32) / 4
    g = torch.randn(m + filler, 64)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = grouped_mm_device_counts(xl, wl, torch.tensor(counts))
    dx, dw = torch.autograd.grad(out, (xl, wl), g)
    xr, wr = x[:m].clone().requires_grad_(), w.clone().requires_grad_()
    ref = _grouped_mm_aligned(xr, wr, counts)
    rx, rw = torch.autograd.grad(ref, (xr, wr), g[:m])
    assert torch.equal(out[:m], ref) and torch.equal(out[m:], torch.zeros(filler, 64))
    assert torch.equal(dx[:m], rx) and torch.equal(dx[m:], torch.zeros(filler, 32))
    assert torch.equal(dw, rw)
    # host counts (lists, CPU tensors: megatron's synced counts) stay strict
    for host in (counts, torch.tensor(counts)):
        with pytest.raises(ValueError, match="sum to M"):
            grouped_mm(x, w, host, backend="loop")


@pytest.mark.gpu
def test_cuda_count_tensor_filler_rows_on_the_loop_backend():
    """fp32 on CUDA (loop backend): a CUDA count tensor summing to less than M gives zero filler rows too."""
    x, w = torch.randn(11, 32, device="cuda"), torch.randn(2, 64, 32, device="cuda")
    out = grouped_mm(x, w, torch.tensor([3, 5], device="cuda"), backend="loop")
    ref = grouped_mm(x[:8], w, [3, 5], backend="loop")
    assert torch.equal(out[:8], ref) and not out[8:].any()


def test_backend_names():
    """``"grouped_mm"`` is the fast path's name (its former name ``"torch"`` is refused), and ``"reference"`` is the
    loop."""
    torch.manual_seed(3)
    x, w, counts = torch.randn(6, 8), torch.randn(2, 16, 8), [2, 4]
    fast = grouped_mm(x, w, counts, backend="grouped_mm")
    with pytest.raises(ValueError, match=r"\('auto', 'grouped_mm', 'loop', 'reference'\)"):
        grouped_mm(x, w, counts, backend="torch")
    assert resolve_backend("reference", x, w) == "loop"
    torch.testing.assert_close(grouped_mm(x, w, counts, backend="reference"), fast)
