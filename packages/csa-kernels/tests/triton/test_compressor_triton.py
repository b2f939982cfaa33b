"""Fused compressor pooling (Triton) vs the reference: pooled entries and the gradients of kv, score and ape."""

from __future__ import annotations

import pytest
import torch
from _cases import bounds_from_lengths, cu_from_lengths

from csa_kernels.ops.compressor import compress, compressor_pool, launch_config
from csa_kernels.ops.compressor import triton as compressor_triton
from csa_kernels.ops.compressor.autograd import compressor_pool_triton
from csa_kernels.ops.compressor.reference import _pool_document, compress_ref, compressor_pool_ref
from dsv4_primitives import RopeConfig
from dsv4_testkit import assert_close_to_ref, interpreting

interpreter_only = pytest.mark.skipif(not interpreting(), reason="CPU interpreter case (gpu cases cover it)")


@pytest.fixture(autouse=True)
def _poisoned_grad_buffers(monkeypatch):
    """dkv / dscore start as NaN: a row the backward kernel fails to write (zeros included) fails the checks."""
    monkeypatch.setattr(compressor_triton, "_grad_buffer", lambda t: torch.full_like(t, float("nan")))


def _pool_oracle(kv, score, ape, ratio, overlap, cu):
    """The reference's per-document pooling evaluated in the inputs' own dtype (tolerance yardstick)."""
    parts = []
    for a, b in zip(cu.host[:-1], cu.host[1:]):
        n = (b - a) // ratio
        if n:
            parts.append(_pool_document(kv[a : a + n * ratio], score[a : a + n * ratio], ape, ratio, overlap))
    c = kv.shape[1] // 2 if overlap else kv.shape[1]
    return torch.cat(parts) if parts else kv.new_zeros(0, c) + 0 * (kv.sum() + score.sum() + ape.sum())


def _run(lengths, c, ratio, overlap, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    dk = 2 * c if overlap else c
    cu = bounds_from_lengths(lengths, device)
    kv = torch.randn(T, dk, generator=gen)
    score = torch.randn(T, dk, generator=gen) * 2
    ape = torch.randn(ratio, dk, generator=gen)
    n_entries = sum(n // ratio for n in lengths)
    dout = torch.randn(n_entries, c, generator=gen)
    kv, score = kv.to(dtype).float(), score.to(dtype).float()  # values exactly representable in `dtype`

    def run(fn, dt, ape_dt):
        # fresh leaves per run (`.to` returns the same tensor when nothing changes: grads would accumulate)
        leaves = [
            kv.to(device=device, dtype=dt).clone().requires_grad_(),
            score.to(device=device, dtype=dt).clone().requires_grad_(),
            ape.to(device=device, dtype=ape_dt).clone().requires_grad_(),
        ]
        out = fn(*leaves, ratio, overlap, cu)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(dout.to(device=device, dtype=out.dtype))
        return [out] + [x.grad for x in leaves]

    r64 = run(compressor_pool_ref, torch.float64, torch.float64)
    rdt = run(_pool_oracle, dtype, dtype)
    got = run(compressor_pool_triton, dtype, torch.float32)
    assert got[0].dtype == torch.float32 and got[0].shape == (n_entries, c)
    assert got[1].dtype == dtype and got[3].dtype == torch.float32
    for name, g, r, rd in zip(("pooled", "dkv", "dscore", "dape"), got, r64, rdt):
        assert_close_to_ref(name, g, r, rd)
    return got, run(compressor_pool_triton, dtype, torch.float32)


CPU_CASES = [
    # lengths, c, ratio, overlap
    (
        [11, 0, 3, 8, 1, 17],
        6,
        4,
        True,
    ),  # CSA layout: odd lengths, empty doc, docs shorter than the ratio, tails
    ([4], 5, 4, True),  # one entry: only the empty previous half
    ([9, 5, 2], 5, 4, False),  # non-overlapping ratio 4
    ([300, 0, 100, 129, 1], 3, 128, False),  # HCA ratio 128: doc shorter than the ratio, one-token tail
    ([13], 4, 3, True),  # ratio not a power of two
    ([0, 0, 9, 0, 2, 5, 0], 3, 2, True),  # leading / consecutive / trailing empty docs (entry -> doc search)
    ([23, 4, 0, 16, 9], 3, 5, True),  # 10 slots: streamed schedule with overlap, masked tail of the last step
    ([2, 0, 1, 13, 2], 4, 3, True),  # leading docs without a complete block (their rows' gradients are 0)
]


@interpreter_only
@pytest.mark.parametrize("case", CPU_CASES)
def test_compressor_pool_interpreter_fp32(case):
    _run(*case, dtype=torch.float32, device="cpu")


@interpreter_only
@pytest.mark.parametrize("held_max_slots", [0, 16])
@pytest.mark.parametrize("case", [CPU_CASES[0], CPU_CASES[2], CPU_CASES[6], CPU_CASES[7]])
def test_compressor_pool_interpreter_both_schedules(case, held_max_slots, monkeypatch):
    """The held (slots in registers) and the streamed (online softmax over slot steps) schedules agree with the
    reference on the same cases: 0 forces streamed everywhere, 16 holds the 10 slots of ratio 5 with overlap."""
    monkeypatch.setattr(launch_config, "HELD_MAX_SLOTS", held_max_slots)
    _run(*case, dtype=torch.float32, device="cpu")


@interpreter_only
@pytest.mark.parametrize("held_max_slots", [0, 16])
def test_compressor_pool_backward_bitwise_reproducible(held_max_slots, monkeypatch):
    """dkv, dscore and dape (per-program partials summed in a fixed order) are bitwise equal over two runs on
    both slot schedules; the shared-atomics variant (``deterministic=False``) gives the same values up to order."""
    monkeypatch.setattr(launch_config, "HELD_MAX_SLOTS", held_max_slots)
    first, again = _run([23, 4, 0, 16, 9], 3, 5, True, dtype=torch.float32, device="cpu")
    for name, a, b in zip(("pooled", "dkv", "dscore", "dape"), first, again):
        assert torch.equal(a, b), f"{name} differs between two runs"
    gen = torch.Generator().manual_seed(1)
    kv, score = torch.randn(52, 6, generator=gen), torch.randn(52, 6, generator=gen)
    ape, dout = torch.randn(5, 6, generator=gen), torch.randn(10, 3, generator=gen)
    cu, cuc = cu_from_lengths([23, 4, 0, 16, 9]), cu_from_lengths([4, 0, 0, 3, 1])
    grads = [
        compressor_triton.compressor_pool_bwd(kv, score, ape, cu, cuc, 8, 5, True, dout[:8], deterministic=d)
        for d in (True, False)
    ]
    torch.testing.assert_close(grads[0][2], grads[1][2], atol=1e-5, rtol=1e-5)


@interpreter_only
def test_compressor_pool_no_complete_block():
    """No document fills a block: an empty result whose backward gives zero gradients."""
    kv = torch.randn(5, 8, requires_grad=True)
    score = torch.randn(5, 8, requires_grad=True)
    ape = torch.randn(4, 8, requires_grad=True)
    cu = bounds_from_lengths([3, 0, 2])
    out, cuc = compressor_pool_triton(kv, score, ape, 4, True, cu)
    assert out.shape == (0, 4) and cuc.cu_seqlens.tolist() == [0, 0, 0, 0]
    out.sum().backward()
    for x in (kv, score, ape):
        assert x.grad is not None and not x.grad.any()


@interpreter_only
def test_public_compressor_backends_agree():
    """backend='triton' through the public names (compressor_pool and the full compress) matches the reference."""
    gen = torch.Generator().manual_seed(4)
    cu = bounds_from_lengths([9, 0, 14])
    kv, score = torch.randn(23, 8, generator=gen), torch.randn(23, 8, generator=gen)
    ape = torch.randn(4, 8, generator=gen)
    a, cua = compressor_pool(kv, score, ape, 4, True, cu, backend="triton")
    b, cub = compressor_pool(kv, score, ape, 4, True, cu, backend="reference")
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert torch.equal(cua.cu_seqlens, cub.cu_seqlens)
    x = torch.randn(23, 16, generator=gen)
    wkv, wgate = torch.randn(8, 16, generator=gen) * 0.25, torch.randn(8, 16, generator=gen) * 0.25
    nw = torch.rand(4, generator=gen) + 0.5
    rope = RopeConfig(rope_dim=2, base=10000.0)
    outs = []
    for backend in ("triton", "reference"):
        leaves = [t.clone().requires_grad_() for t in (x, wkv, wgate, ape)]
        e, _ = compress(leaves[0], leaves[1], leaves[2], leaves[3], nw, 4, True, rope, cu, backend=backend)
        e.square().sum().backward()
        outs.append([e] + [t.grad for t in leaves])
    for g, r in zip(*outs):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    ref, _ = compress_ref(x, wkv, wgate, ape, nw, 4, True, rope, cu)
    torch.testing.assert_close(outs[0][0], ref, atol=1e-5, rtol=1e-5)


GPU_CASES = [
    ([11, 0, 3, 8, 1, 17], 6, 4, True),
    ([300, 0, 100, 129, 1], 3, 128, False),
    ([1000, 3, 517], 512, 4, True),  # CSA attention compressor width (Dk = 1024)
    ([600, 77], 128, 4, True),  # indexer compressor width
    ([1031, 256, 100], 512, 128, False),  # HCA width
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_compressor_pool_gpu_bf16(case):
    _run(*case, dtype=torch.bfloat16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[-1]])
def test_compressor_pool_gpu_bf16_bitwise_reproducible(case):
    """dkv, dscore and dape (per-program partials summed in a fixed order) bitwise equal over two runs on the GPU,
    where shared atomics would race (issue 20)."""
    first, again = _run(*case, dtype=torch.bfloat16, device="cuda")
    for name, a, b in zip(("pooled", "dkv", "dscore", "dape"), first, again):
        assert torch.equal(a, b), f"{name} differs between two runs"
