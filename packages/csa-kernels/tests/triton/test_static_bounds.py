"""Static boundaries (``SeqBoundaries.static``, the CUDA-graph mode) vs host boundaries through the same ops: index
maps, compressor pooling, indexer top-k and dense scores, outputs and every gradient, on static-shape packs (several documents, documents shorter than the window and
than a ratio-128 group, an empty-capacity tail, a pack at exactly its document capacity)."""

from __future__ import annotations

import pytest
import torch
from _cases import cu_from_lengths

from csa_kernels import (
    compressed_positions,
    compressor_pool,
    indexer_scores,
    indexer_topk,
    visible_compressed_indices,
    window_indices,
)
from csa_kernels.ops.compressor import triton as compressor_triton
from csa_kernels.ops.indexer.device_plan import row_block_table
from csa_kernels.ops.indexer.triton import _row_blocks
from dsv4_primitives.varlen import SeqBoundaries, compressed_cu_seqlens_host
from dsv4_testkit import interpreting

interpreter_only = pytest.mark.skipif(not interpreting(), reason="CPU interpreter case (gpu cases cover it)")

# (document lengths, empty capacity slots after them): the pack ends at its last document (T = sum)
PACKS = [
    (
        [37, 5, 130, 3, 9],
        2,
    ),  # several documents, short ones (< window, < a ratio-128 group), empty tail slots
    ([200, 1, 56], 0),  # exactly at the document capacity
    ([3, 2], 3),  # no document holds a ratio-128 group
]


# (pack, ratio) cases of the interpreted kernels: ratio 4 on the short packs, ratio 128 on the ones that hold groups
# (the interpreter's cost grows with T * entries; every pack shape is still covered at one ratio or both)
KERNEL_CASES = [(PACKS[0], 4), (PACKS[2], 4), (PACKS[0], 128), (PACKS[1], 128)]


def _bounds(lengths, spare):
    cu = cu_from_lengths(lengths)
    host = cu.tolist()
    static = torch.cat([cu, cu[-1:].expand(spare)])  # unused slots repeat the end
    return host, SeqBoundaries(cu, tuple(host)), SeqBoundaries.static(static, sum(lengths))


@pytest.fixture(autouse=True)
def _poisoned_grad_buffers(monkeypatch):
    monkeypatch.setattr(compressor_triton, "_grad_buffer", lambda t: torch.full_like(t, float("nan")))


@pytest.mark.parametrize("lengths,spare", PACKS)
def test_index_maps_equal_host(lengths, spare):
    host, cu, b = _bounds(lengths, spare)
    assert torch.equal(window_indices(b, 8), window_indices(cu, 8))
    for ratio in (4, 128):
        cuc_host = compressed_cu_seqlens_host(host, ratio)
        assert b.compressed(ratio).cu_seqlens.tolist()[: len(host)] == cuc_host
        vis = visible_compressed_indices(b, ratio)
        assert vis.shape == (b.total, b.total // ratio)
        ref = visible_compressed_indices(cu, ratio)
        assert torch.equal(vis[:, : ref.shape[1]], ref)
        assert bool((vis[:, ref.shape[1] :] == -1).all())
        pos = compressed_positions(b, ratio)[: cuc_host[-1]]
        expect = [
            (e - cuc_host[d]) * ratio
            for d in range(len(lengths))
            for e in range(cuc_host[d], cuc_host[d + 1])
        ]
        assert pos.tolist() == expect


@pytest.mark.parametrize("lengths,spare", PACKS)
def test_row_block_table_equals_host_plan(lengths, spare):
    host, _, b = _bounds(lengths, spare)
    cuc = compressed_cu_seqlens_host(host, 4)
    plan = _row_blocks(host, cuc, 16)
    table = row_block_table(b, 4, 16)
    used = table[:, : len(plan)].t().tolist()
    assert [tuple(r) for r in used] == plan
    assert bool((table[:, len(plan) :] == 0).all())  # empty slots


def _grads(out, leaves, cot):
    return torch.autograd.grad(out, leaves, cot)


@interpreter_only
@pytest.mark.parametrize("pack,ratio", KERNEL_CASES)
def test_compressor_pool_static_equals_host(pack, ratio):
    overlap = ratio == 4
    host, cu, b = _bounds(*pack)
    gen = torch.Generator().manual_seed(1)
    c = 8
    dk = 2 * c if overlap else c
    kv = torch.randn(b.total, dk, generator=gen, requires_grad=True)
    score = torch.randn(b.total, dk, generator=gen, requires_grad=True)
    ape = torch.randn(ratio, dk, generator=gen, requires_grad=True)
    pooled, cuc = compressor_pool(kv, score, ape, ratio, overlap, cu, backend="triton")
    tc = pooled.shape[0]
    stat, cuc_s = compressor_pool(kv, score, ape, ratio, overlap, b, backend="triton")
    assert stat.shape == (b.total // ratio, c)
    assert torch.equal(stat[:tc], pooled) and bool((stat[tc:] == 0).all())
    assert cuc_s.cu_seqlens.tolist()[: len(host)] == cuc.cu_seqlens.tolist()
    dout = torch.randn(stat.shape, generator=gen)  # padding rows' cotangent must not reach any input
    g_host = _grads(pooled, (kv, score, ape), dout[:tc])
    g_stat = _grads(stat, (kv, score, ape), dout)
    for a, s in zip(g_host, g_stat):
        assert torch.equal(a, s)
    # the reference backend's static form matches too
    ref, _ = compressor_pool(kv, score, ape, ratio, overlap, b, backend="reference")
    torch.testing.assert_close(ref, stat, atol=1e-5, rtol=1e-5)


def _indexer_inputs(b: SeqBoundaries, ratio, seed=0, HI=2, DI=16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b.total, HI, DI, generator=gen).requires_grad_()
    k = torch.randn(b.compressed(ratio).total, DI, generator=gen).requires_grad_()
    w = (torch.randn(b.total, HI, generator=gen) * (DI * HI) ** -0.5).requires_grad_()
    return q, k, w


@interpreter_only
@pytest.mark.parametrize("pack,ratio", KERNEL_CASES)
def test_indexer_topk_static_equals_host(pack, ratio):
    topk = 6 if ratio == 4 else 2
    host, cu, b = _bounds(*pack)
    cuc_host = compressed_cu_seqlens_host(host, ratio)
    tc = cuc_host[-1]
    q, k, w = _indexer_inputs(b, ratio)
    idx, val = indexer_topk(q, k[:tc], w, ratio, topk, cu, backend="triton")
    sidx, sval = indexer_topk(q, k, w, ratio, topk, b, backend="triton")
    assert torch.equal(sidx, idx) and torch.equal(sval, val)  # one chunk: the host plan's row blocks, bitwise
    gen = torch.Generator().manual_seed(2)
    cot = torch.where(torch.isfinite(val), torch.randn(val.shape, generator=gen), 0.0)
    g_host = _grads(val, (q, k, w), cot)
    g_stat = _grads(sval, (q, k, w), cot)
    for a, s in zip(g_host, g_stat):  # (k's gradient is zero on the padding entries in both: k[:tc] above)
        assert torch.equal(a, s)
    assert bool((g_stat[1][tc:] == 0).all())
    if (
        ratio == 4
    ):  # fixed row chunks (several: row blocks clipped at the chunk edges) select the same entries
        cidx, cval = indexer_topk(q, k, w, ratio, topk, b, 32, backend="triton")
        assert torch.equal(cidx, idx)
        torch.testing.assert_close(cval, val, atol=1e-6, rtol=1e-6)
    # and the reference backend's static form (bounds read back) too
    ridx, _ = indexer_topk(q, k, w, ratio, topk, b, backend="reference")
    assert torch.equal(ridx, idx)


@interpreter_only
@pytest.mark.parametrize("pack,ratio", KERNEL_CASES)
def test_indexer_scores_static_equals_host(pack, ratio):
    host, cu, b = _bounds(*pack)
    cuc_host = compressed_cu_seqlens_host(host, ratio)
    tc = cuc_host[-1]
    q, k, w = _indexer_inputs(b, ratio, seed=3)
    dense = indexer_scores(q, k[:tc], w, ratio, cu, backend="triton")  # [T, max_c]
    stat = indexer_scores(q, k, w, ratio, b, backend="triton")  # [T, T // ratio]
    m = dense.shape[1]
    assert stat.shape == (b.total, b.total // ratio)
    assert torch.equal(torch.isfinite(stat[:, :m]), torch.isfinite(dense))
    assert bool(torch.isneginf(stat[:, m:]).all())
    fin = torch.isfinite(dense)
    torch.testing.assert_close(
        stat[:, :m][fin], dense[fin], atol=1e-6, rtol=1e-6
    )  # fp32: summation order only
    gen = torch.Generator().manual_seed(4)
    cot = torch.where(fin, torch.randn(dense.shape, generator=gen), 0.0)
    g_host = _grads(dense, (q, k, w), cot)
    g_stat = _grads(stat, (q, k, w), torch.nn.functional.pad(cot, (0, stat.shape[1] - m)))
    torch.testing.assert_close(g_stat[0], g_host[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_stat[1], g_host[1], atol=1e-5, rtol=1e-5)  # both zero past the real entries
    assert bool((g_stat[1][tc:] == 0).all())
    torch.testing.assert_close(g_stat[2], g_host[2], atol=1e-5, rtol=1e-5)


def test_static_bounds_validation():
    with pytest.raises(ValueError, match="document slot"):
        SeqBoundaries.static(torch.zeros(1, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="int32"):
        SeqBoundaries.static(torch.zeros(3), 4)
    b = SeqBoundaries.static(torch.tensor([0, 4, 8], dtype=torch.int32), 8)
    q = torch.zeros(8, 1, 4)
    with pytest.raises(ValueError, match="T // ratio"):
        indexer_topk(q, torch.zeros(3, 4), torch.zeros(8, 1), 4, 2, b, backend="reference")


@interpreter_only
def test_static_ops_read_nothing_back():
    """Every op on static boundaries, forward and backward, reads no tensor value on the host (the capture rule): the
    index maps, the pooling, the top-k and the dense scores on the Triton backend under the host-read detector."""
    from _nosync import no_host_reads

    _, _, b = _bounds([9, 7, 3], 2)
    gen = torch.Generator().manual_seed(5)
    kv = torch.randn(b.total, 16, generator=gen, requires_grad=True)
    score = torch.randn(b.total, 16, generator=gen, requires_grad=True)
    ape = torch.randn(4, 16, generator=gen, requires_grad=True)
    q, k, w = _indexer_inputs(b, 4, seed=6)
    with no_host_reads():
        window_indices(b, 8)
        visible_compressed_indices(b, 4)
        compressed_positions(b, 4)
        pooled, _ = compressor_pool(kv, score, ape, 4, True, b, backend="triton")
        _, vals = indexer_topk(q, k, w, 4, 3, b, backend="triton")
        dense = indexer_scores(q, k, w, 4, b, backend="triton")
        loss = pooled.sum() + torch.where(torch.isfinite(vals), vals, 0).sum()
        loss = loss + torch.where(torch.isfinite(dense), dense, 0).sum()
        loss.backward()
    assert kv.grad is not None and q.grad is not None and k.grad is not None
