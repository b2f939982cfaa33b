"""Sparse attention with sink: oracles A1 (gather == dense masked) and A2 (sink limits), -1 / repeated indices,
THD vs SBHD, chunking, gradients vs finite differences."""

import math

import pytest
import torch

from csa_kernels import (
    attention_indices,
    csa_dense_mask,
    indices_to_mask,
    sparse_attn,
    sparse_attn_dense_ref,
    sparse_attn_ref,
    sparse_attn_sbhd,
    visible_compressed_indices,
    window_indices,
)
from dsv4_primitives.varlen import SeqBoundaries, compressed_cu_seqlens, cu_seqlens_from_lengths

LENGTHS = [1, 3, 7, 8, 0, 16, 37, 64, 100]


def _loop_oracle(q, kv, sink, indices, scale):
    """Row by row, head by head, straight from the formula (float64)."""
    t_, h_, d_ = q.shape
    o = torch.zeros(t_, h_, d_, dtype=torch.float64)
    lse = torch.zeros(t_, h_, dtype=torch.float64)
    for t in range(t_):
        rows = [int(i) for i in indices[t] if i >= 0]
        for h in range(h_):
            z = [float(q[t, h] @ kv[r]) * scale for r in rows]
            denom = sum(math.exp(v) for v in z) + math.exp(float(sink[h]))
            lse[t, h] = math.log(denom)
            for v, r in zip(z, rows):
                o[t, h] += math.exp(v) / denom * kv[r]
    return o, lse


def _random_indices(t, n_kv, k, p_invalid=0.3, repeats=True):
    idx = torch.randint(0, n_kv, (t, k))
    idx[torch.rand(t, k) < p_invalid] = -1
    if repeats and k > 1:
        idx[:, -1] = idx[:, 0]
    idx[0] = -1  # one all-invalid row
    return idx.to(torch.int32)


def test_matches_loop_oracle_with_invalid_and_repeated():
    t, h, d, n_kv, k = 9, 3, 5, 11, 6
    q = torch.randn(t, h, d, dtype=torch.float64)
    kv = torch.randn(n_kv, d, dtype=torch.float64)
    sink = torch.randn(h, dtype=torch.float64)
    idx = _random_indices(t, n_kv, k)
    o, lse = sparse_attn(q, kv, sink, idx, 0.4)
    o_ref, lse_ref = _loop_oracle(q, kv, sink, idx, 0.4)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(lse, lse_ref)
    # all-invalid row: o = 0, lse = sink
    assert torch.equal(o[0], torch.zeros_like(o[0]))
    torch.testing.assert_close(lse[0], sink)


@pytest.mark.parametrize("ratio", [4, 8])
def test_a1_gather_equals_dense_masked(ratio):
    window, h, d = 5, 2, 8
    cu = cu_seqlens_from_lengths(LENGTHS)
    cu_c = compressed_cu_seqlens(cu, ratio)
    t, tc = int(cu[-1]), int(cu_c[-1])
    q = torch.randn(t, h, d, dtype=torch.float64)
    kv_all = torch.randn(t + tc, d, dtype=torch.float64)
    sink = torch.randn(h, dtype=torch.float64)
    idx = attention_indices(
        window_indices(SeqBoundaries.from_tensor(cu), window),
        visible_compressed_indices(SeqBoundaries.from_tensor(cu), ratio),
        t,
    )
    o, lse = sparse_attn_ref(q, kv_all, sink, idx, d**-0.5)
    o_d, lse_d = sparse_attn_dense_ref(
        q, kv_all, sink, csa_dense_mask(SeqBoundaries.from_tensor(cu), ratio, window), d**-0.5
    )
    torch.testing.assert_close(o, o_d, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_d, rtol=1e-12, atol=1e-12)
    # sparse selection with -1 and repeats: dense form with multiplicities
    sel = _random_indices(t, t + tc, 7)
    o, lse = sparse_attn_ref(q, kv_all, sink, sel, 0.3)
    o_d, lse_d = sparse_attn_dense_ref(q, kv_all, sink, indices_to_mask(sel, t + tc), 0.3)
    torch.testing.assert_close(o, o_d, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_d, rtol=1e-12, atol=1e-12)


def test_a2_sink_limits():
    t, h, d, n_kv, k = 6, 2, 4, 9, 5
    q = torch.randn(t, h, d, dtype=torch.float64)
    kv = torch.randn(n_kv, d, dtype=torch.float64)
    idx = torch.randint(0, n_kv, (t, k), dtype=torch.int32)
    scale = 0.5
    # sink -> -inf: ordinary softmax attention
    o, lse = sparse_attn_ref(q, kv, torch.full((h,), -1e4, dtype=torch.float64), idx, scale)
    rows = kv[idx.long()]  # [T, K, D]
    z = torch.einsum("thd,tkd->thk", q, rows) * scale
    torch.testing.assert_close(o, torch.einsum("thk,tkd->thd", torch.softmax(z, -1), rows))
    torch.testing.assert_close(lse, torch.logsumexp(z, -1))
    # sink -> +inf: output -> 0
    o, _ = sparse_attn_ref(q, kv, torch.full((h,), 1e3, dtype=torch.float64), idx, scale)
    assert o.abs().max() < 1e-300
    # general: sum_j p = 1 / (1 + exp(sink) / sum exp(z)); with kv rows = e_0 the output reads off sum_j p
    sink = torch.randn(h, dtype=torch.float64)
    ones = torch.zeros(n_kv, d, dtype=torch.float64)
    ones[:, 0] = 1.0
    qz = torch.zeros_like(q)
    o, lse = sparse_attn_ref(qz, ones, sink, idx, scale)
    mass = 1.0 / (1.0 + torch.exp(sink)[None, :] / k)  # z = 0 for every candidate
    torch.testing.assert_close(o[..., 0], mass.expand(t, h))
    assert (o[..., 0] < 1).all()


def test_thd_equals_sbhd_and_single_document():
    s, b, h, d, k = 37, 3, 2, 6, 8
    q = torch.randn(s, b, h, d, dtype=torch.float64)
    kv = torch.randn(s + 9, b, d, dtype=torch.float64)
    sink = torch.randn(h, dtype=torch.float64)
    idx = torch.stack([_random_indices(s, s + 9, k) for _ in range(b)], 1)  # [S, B, K] local
    o, lse = sparse_attn_sbhd(q, kv, sink, idx, 0.3)
    assert o.shape == (s, b, h, d) and lse.shape == (s, b, h)
    for i in range(b):
        o1, lse1 = sparse_attn(q[:, i], kv[:, i], sink, idx[:, i], 0.3)
        torch.testing.assert_close(o[:, i], o1, rtol=0, atol=0)
        torch.testing.assert_close(lse[:, i], lse1, rtol=0, atol=0)


def test_chunking_is_exact_in_forward_and_backward():
    t, h, d, n_kv, k = 23, 2, 4, 15, 6
    q = torch.randn(t, h, d, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(n_kv, d, dtype=torch.float64, requires_grad=True)
    sink = torch.randn(h, dtype=torch.float64, requires_grad=True)
    idx = _random_indices(t, n_kv, k)
    go, gl = torch.randn(t, h, d, dtype=torch.float64), torch.randn(t, h, dtype=torch.float64)
    outs = []
    for chunk in (None, 1, 5):
        o, lse = sparse_attn_ref(q, kv, sink, idx, 0.3, chunk_size=chunk)
        grads = torch.autograd.grad((o * go).sum() + (lse * gl).sum(), (q, kv, sink))
        outs.append((o, lse, *grads))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_gradcheck_all_inputs():
    t, h, d, n_kv, k = 5, 2, 3, 7, 4
    q = torch.randn(t, h, d, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(n_kv, d, dtype=torch.float64, requires_grad=True)
    sink = torch.randn(h, dtype=torch.float64, requires_grad=True)
    idx = _random_indices(t, n_kv, k)
    assert torch.autograd.gradcheck(lambda a, b, c: sparse_attn_ref(a, b, c, idx, 0.7), (q, kv, sink))
    assert torch.autograd.gradcheck(
        lambda a, b, c: sparse_attn_ref(a, b, c, idx, 0.7, chunk_size=2), (q, kv, sink)
    )


def test_dtype_policy():
    q = torch.randn(4, 2, 8).bfloat16()
    kv = torch.randn(6, 8).bfloat16()
    o, lse = sparse_attn(q, kv, torch.zeros(2), torch.zeros(4, 3, dtype=torch.int32), 0.3)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32


def test_bad_inputs():
    q, kv, sink = torch.randn(4, 2, 8), torch.randn(6, 8), torch.zeros(2)
    idx = torch.zeros(4, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="indices"):
        sparse_attn(q, kv, sink, idx + 6, 0.3)
    with pytest.raises(ValueError, match="indices"):
        sparse_attn(q, kv, sink, idx - 2, 0.3)
    with pytest.raises(ValueError, match="attn_sink"):
        sparse_attn(q, kv, torch.zeros(3), idx, 0.3)
    with pytest.raises(ValueError, match="finite"):
        sparse_attn(q, kv, torch.full((2,), float("-inf")), idx, 0.3)
    with pytest.raises(ValueError, match="kv"):
        sparse_attn(q, kv[:, :4], sink, idx, 0.3)
    with pytest.raises(ValueError, match="indices"):
        sparse_attn(q, kv, sink, idx.float(), 0.3)
