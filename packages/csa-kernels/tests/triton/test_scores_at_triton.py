"""Fused index scores at given entries (Triton, forward + backward) vs the fp32/fp64 reference, and the top-k
gradient path that uses the fused backward without recomputing the forward."""

from __future__ import annotations

import pytest
import torch
from _cases import bounds_of, cu_from_lengths

from csa_kernels.ops.indexer import indexer_scores_at, indexer_topk
from csa_kernels.ops.indexer import scores_at_autograd as SA
from csa_kernels.ops.indexer.reference import indexer_scores_at_ref
from csa_kernels.ops.indexer.scores_at_autograd import indexer_scores_at_triton
from csa_kernels.ops.indexer.triton import indexer_topk_triton
from dsv4_primitives.varlen import compressed_cu_seqlens
from dsv4_testkit import assert_close_to_ref, interpreting

interpreter_only = pytest.mark.skipif(not interpreting(), reason="CPU interpreter case (gpu cases cover it)")
NAMES = ("score", "dq", "dk", "dw")


def scores_at_case(T, HI, DI, Tc, K, seed=0, holes=True, empty_rows=()):
    """q, k, w and indices ``[T, K]`` int32 like top-k's: distinct entries per row, ``-1`` trailing (and, with
    ``holes``, scattered in every third row), a random number of valid slots per row, ``empty_rows`` all ``-1``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, HI, DI, generator=gen)
    k = torch.randn(Tc, DI, generator=gen)
    w = torch.randn(T, HI, generator=gen) * (HI * DI) ** -0.5
    idx = torch.full((T, K), -1, dtype=torch.int32)
    for t in range(T):
        n = int(torch.randint(0, min(K, Tc) + 1, (1,), generator=gen)) if t % 4 else min(K, Tc)
        idx[t, :n] = torch.randperm(Tc, generator=gen)[:n].to(torch.int32)
        if holes and t % 3 == 1:
            idx[t] = idx[t, torch.randperm(K, generator=gen)]
    for t in empty_rows:
        idx[t] = -1
    return q, k, w, idx


def same_dtype_oracle(q, k, w, idx):
    """Plain PyTorch in the inputs' own dtype (the tolerance yardstick): gather, dot, ReLU, weighted head sum."""
    valid = idx >= 0
    kk = torch.cat((k, k.new_zeros(1, k.shape[1])))  # row Tc = the zero row of -1 slots (Tc may be 0)
    rows = kk.index_select(0, torch.where(valid, idx, k.shape[0]).reshape(-1).long()).view(*idx.shape, -1)
    s = torch.einsum("thd,tkd->thk", q, rows)  # [T, HI, K]
    return torch.einsum("thk,th->tk", torch.relu(s), w).masked_fill(~valid, float("-inf"))


def _forward_backward(fn, q, k, w, idx, g, dtype, device):
    leaves = [x.detach().to(device=device, dtype=dtype).clone().requires_grad_() for x in (q, k, w)]
    s = fn(*leaves, idx.to(device))
    s.backward(g.to(device=device, dtype=s.dtype))
    return [s.detach()] + [x.grad for x in leaves]


def check_scores_at(q, k, w, idx, dtype, device, seed=1, deterministic=False):
    """Score and all gradients of the fused op vs the fp64 reference, under the testkit tolerance rule; the
    upstream gradient is nonzero at ``-1`` slots too (the kernel must ignore it there). ``deterministic``: the
    key-major ``dk``, and the backward run twice must give the same bits."""
    q, k, w = (x.to(dtype) for x in (q, k, w))  # the kernel and the references see the same rounded inputs
    g = torch.randn(idx.shape, generator=torch.Generator().manual_seed(seed))

    def fused(*a):
        return indexer_scores_at_triton(*a, deterministic=deterministic)

    got = _forward_backward(fused, q, k, w, idx, g, dtype, device)
    if deterministic:
        again = _forward_backward(fused, q, k, w, idx, g, dtype, device)
        for name, a, b in zip(NAMES, got, again):
            assert torch.equal(a, b), f"{name} differs between two deterministic runs"
    ref = _forward_backward(indexer_scores_at_ref, q, k, w, idx, g, torch.float64, device)
    oracle = indexer_scores_at_ref if dtype == torch.float32 else same_dtype_oracle
    ydt = _forward_backward(oracle, q, k, w, idx, g, dtype, device)
    valid = (idx >= 0).to(device)
    assert got[0].dtype == torch.float32 and got[0].shape == idx.shape
    assert torch.equal(torch.isneginf(got[0]), ~valid) and bool(torch.isfinite(got[0][valid]).all())
    for name, a, r, y in zip(NAMES, got, ref, ydt):
        if name == "score":
            a, r, y = (torch.where(valid, x, 0.0) for x in (a, r, y))
        else:
            assert a.dtype == dtype
        assert_close_to_ref(name, a, r, y)


CPU_CASES = [
    # T, HI, DI, Tc, K, empty_rows
    (1, 4, 32, 7, 5, ()),  # one row
    (9, 3, 64, 11, 6, (2,)),  # HI not a power of two, an all -1 row
    (7, 5, 24, 6, 9, ()),  # DI not a power of two, K larger than the number of entries (-1 padded)
    (6, 80, 16, 20, 18, ()),  # two head blocks (BLOCK_H 64): dk adds from both, more slots than one tile
    (5, 2, 32, 0, 4, ()),  # empty compressed buffer (Tc = 0): every slot -1
    (4, 2, 16, 9, 0, ()),  # K = 0
]


@interpreter_only
@pytest.mark.parametrize("case", CPU_CASES)
def test_scores_at_interpreter_fp32(case):
    T, HI, DI, Tc, K, empty = case
    check_scores_at(*scores_at_case(T, HI, DI, Tc, K, seed=T + HI, empty_rows=empty), torch.float32, "cpu")


@interpreter_only
@pytest.mark.parametrize("case", CPU_CASES[1:5] + [(40, 3, 16, 37, 9, (4,))])
def test_scores_at_interpreter_deterministic(case):
    """The atomic-free key-major dk (several entry blocks of BLOCK_R 16 in the last case): gradients vs the
    reference, bitwise equal over two runs."""
    T, HI, DI, Tc, K, empty = case
    q, k, w, idx = scores_at_case(T, HI, DI, Tc, K, seed=T + HI, empty_rows=empty)
    check_scores_at(q, k, w, idx, torch.float32, "cpu", deterministic=True)


@interpreter_only
@pytest.mark.parametrize("deterministic", [False, True])
def test_scores_at_repeated_entries_accumulate(deterministic):
    """Top-k never repeats an entry in a row, but the op must still sum repeated entries (dk atomics, or the
    key-major pass's per-row sum of the upstream gradient over the repeated slots)."""
    q, k, w, _ = scores_at_case(5, 2, 16, 3, 6)
    idx = torch.tensor([[0, 0, 1, -1, 0, 2]] * 5, dtype=torch.int32)
    check_scores_at(q, k, w, idx, torch.float32, "cpu", deterministic=deterministic)


@interpreter_only
def test_public_scores_at_backends(monkeypatch):
    """backend='triton' runs the fused op (interpreter); 'auto' on CPU runs the reference; both agree."""
    q, k, w, idx = scores_at_case(6, 3, 16, 8, 5, seed=4)
    calls = []
    real = SA.indexer_scores_at_triton
    monkeypatch.setattr(SA, "indexer_scores_at_triton", lambda *a: calls.append(1) or real(*a))
    fused = indexer_scores_at(q, k, w, idx, backend="triton")
    assert calls == [1]
    ref = indexer_scores_at(q, k, w, idx)
    assert calls == [1]
    torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-5)
    bad = idx.clone()
    bad[2, 1] = k.shape[0]  # one past the last entry
    with pytest.raises(ValueError, match="indices values must lie in"):
        indexer_scores_at(q, k, w, bad, backend="triton")


# ----------------------------------------------------------------------------- indexer_topk gradient path
def _topk_inputs(lengths, HI, DI, ratio, seed):
    gen = torch.Generator().manual_seed(seed)
    cu = cu_from_lengths(lengths)
    cuc = compressed_cu_seqlens(cu, ratio)
    T, Tc = sum(lengths), int(cuc[-1])
    q = torch.randn(T, HI, DI, generator=gen)
    k = torch.randn(Tc, DI, generator=gen)
    w = torch.randn(T, HI, generator=gen) * (HI * DI) ** -0.5
    return q, k, w, bounds_of(cu)


def check_topk_gradient_path(lengths, HI, DI, ratio, topk, dtype, device, seed=0):
    """indexer_topk(backend='triton'): indices and forward values exactly those of the selection pass; gradients
    of the scores equal (tolerance rule) those of the reference formulation ``where(idx >= 0,
    indexer_scores_at_ref(..., idx), 0)`` at the SAME selection (fp64), yardstick: that formulation in ``dtype``."""
    q, k, w, b = _topk_inputs(lengths, HI, DI, ratio, seed)
    q, k, w, b = q.to(device), k.to(device), w.to(device), b.to(device)
    q, k, w = (x.to(dtype) for x in (q, k, w))
    sel_idx, sel_vals = indexer_topk_triton(q, k, w, ratio, topk, b)
    g = torch.randn(sel_idx.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    leaves = [x.clone().requires_grad_() for x in (q, k, w)]
    idx, vals = indexer_topk(*leaves, ratio, topk, b, backend="triton")
    assert torch.equal(idx, sel_idx) and torch.equal(vals.detach(), sel_vals)  # same values, -inf included
    assert vals.requires_grad
    (torch.where(idx >= 0, vals, 0.0) * g).sum().backward()
    got = [x.grad for x in leaves]
    outs = []
    for fn, dt in ((indexer_scores_at_ref, torch.float64), (indexer_scores_at_ref, torch.float32)):
        if dtype != torch.float32 and dt == torch.float32:
            fn, dt = same_dtype_oracle, dtype
        ref_leaves = [x.detach().to(dt).requires_grad_() for x in (q, k, w)]
        live = fn(*ref_leaves, idx)
        (torch.where(idx >= 0, live, 0.0) * g.to(live.dtype)).sum().backward()
        outs.append([x.grad for x in ref_leaves])
    for name, a, r, y in zip(NAMES[1:], got, *outs):
        assert a.dtype == dtype
        assert_close_to_ref(name, a, r, y)


TOPK_CPU_CASES = [
    # lengths, HI, DI, ratio, topk
    ([21, 6], 2, 16, 4, 3),
    (
        [1, 0, 9, 23],
        3,
        24,
        4,
        40,
    ),  # empty / length-1 docs, top-k larger than the entries, DI not a power of 2
    ([3, 2], 2, 16, 4, 4),  # every document shorter than the ratio: Tc = 0
]


@interpreter_only
@pytest.mark.parametrize("case", TOPK_CPU_CASES)
def test_topk_gradient_path_interpreter(case):
    check_topk_gradient_path(*case, dtype=torch.float32, device="cpu")


@interpreter_only
def test_topk_gradient_path_does_not_recompute_forward(monkeypatch):
    """The forward values come from the selection pass: neither the fused forward nor the reference runs."""

    def forbidden(*args, **kwargs):
        raise AssertionError("forward recomputation in indexer_topk")

    monkeypatch.setattr(SA, "scores_at_fwd", forbidden)
    monkeypatch.setattr("csa_kernels.ops.indexer.reference.indexer_scores_at_ref", forbidden)
    q, k, w, b = _topk_inputs([13, 7], 2, 16, 4, seed=2)
    leaves = [x.requires_grad_() for x in (q, k, w)]
    idx, vals = indexer_topk(*leaves, 4, 2, b, backend="triton")
    torch.where(idx >= 0, vals, 0.0).sum().backward()
    assert all(x.grad is not None for x in leaves)


@interpreter_only
def test_topk_gradient_path_deterministic_mode(monkeypatch):
    """Under torch.use_deterministic_algorithms(True) the backward takes the atomic-free key-major dk (it ran the
    fp32 reference before 0.3): gradients equal to the reference formulation (fp32 tolerance), bitwise equal over
    two runs; ``deterministic=True`` does the same without the global flag."""
    seen = []
    real = SA.scores_at_bwd
    monkeypatch.setattr(
        SA,
        "scores_at_bwd",
        lambda *a, deterministic: seen.append(deterministic) or real(*a, deterministic=deterministic),
    )
    q, k, w, b = _topk_inputs([17, 5], 2, 16, 4, seed=3)
    idx, _ = indexer_topk_triton(q, k, w, 4, 3, b)
    g = torch.randn(idx.shape)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, w)]
    (torch.where(idx >= 0, indexer_scores_at_ref(*ref_leaves, idx), 0.0) * g).sum().backward()

    def run(**kw):
        leaves = [x.clone().requires_grad_() for x in (q, k, w)]
        _, vals = indexer_topk(*leaves, 4, 3, b, backend="triton", **kw)
        (torch.where(idx >= 0, vals, 0.0) * g).sum().backward()
        return [x.grad for x in leaves]

    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first = run()
    finally:
        torch.use_deterministic_algorithms(prev)
    second = run(deterministic=True)
    assert seen == [True, True]
    for a, b, r in zip(first, second, ref_leaves):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, r.grad, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize(
    "case,dtype",
    [
        ((4096, 64, 128, 1024, 512, (5, 100)), torch.bfloat16),  # the flash-smoke indexer shape
        ((300, 64, 128, 200, 512, (0,)), torch.bfloat16),  # K larger than the entries
        ((257, 5, 64, 77, 40, ()), torch.bfloat16),  # HI not a power of two, DI 64
        ((129, 80, 32, 50, 24, ()), torch.bfloat16),  # two head blocks, DI 32
        ((64, 2, 32, 0, 8, ()), torch.bfloat16),  # Tc = 0
        ((513, 64, 128, 300, 96, (3,)), torch.float32),  # exact fp32 dots
    ],
)
def test_scores_at_gpu(case, dtype):
    T, HI, DI, Tc, K, empty = case
    check_scores_at(*scores_at_case(T, HI, DI, Tc, K, seed=T, empty_rows=empty), dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "lengths,HI,DI,topk,dtype",
    [
        ([4096], 64, 128, 512, torch.bfloat16),  # flash-smoke
        ([1000, 3, 517, 0, 2], 64, 128, 64, torch.bfloat16),
        ([700, 33], 64, 128, 96, torch.float32),
    ],
)
def test_topk_gradient_path_gpu(lengths, HI, DI, topk, dtype):
    check_topk_gradient_path(lengths, HI, DI, 4, topk, dtype, "cuda")


@pytest.mark.gpu
def test_public_scores_at_auto_is_fused_on_cuda(monkeypatch):
    monkeypatch.delenv("CSA_KERNELS_BACKEND", raising=False)
    calls = []
    real = SA.indexer_scores_at_triton
    monkeypatch.setattr(SA, "indexer_scores_at_triton", lambda *a: calls.append(1) or real(*a))
    q, k, w, idx = (x.cuda() for x in scores_at_case(33, 4, 32, 10, 6))
    out = indexer_scores_at(q.bfloat16(), k.bfloat16(), w.bfloat16(), idx)
    assert calls == [1] and out.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    [(4096, 64, 128, 1024, 512, (5, 100)), (513, 64, 128, 300, 96, (3,))],  # flash-smoke indexer; odd shapes
)
def test_scores_at_gpu_bf16_deterministic(case):
    """The key-major ``dk`` on the GPU, where the atomic one races: gradients vs the reference, and two runs
    bitwise equal (issue 20, ``dsv4 train --deterministic``)."""
    T, HI, DI, Tc, K, empty = case
    q, k, w, idx = scores_at_case(T, HI, DI, Tc, K, seed=T, empty_rows=empty)
    check_scores_at(q, k, w, idx, torch.bfloat16, "cuda", deterministic=True)
