"""Lightning indexer: scores vs a loop oracle, oracles I1, I2, I4, I6 (ties), top-k > visible, THD vs SBHD,
chunked memory bound, gradients vs finite differences."""

import pytest
import torch

from csa_kernels import (
    attention_indices,
    indexer_scores,
    indexer_scores_at,
    indexer_scores_sbhd,
    indexer_topk,
    indexer_topk_ref,
    indexer_topk_sbhd,
    sparse_attn,
    visible_compressed_indices,
    window_indices,
)
from dsv4_primitives.varlen import SeqBoundaries, compressed_cu_seqlens, cu_seqlens_from_lengths

LENGTHS = [1, 3, 7, 8, 0, 16, 37, 64, 100]


def _b(cu: torch.Tensor) -> SeqBoundaries:
    """The ops' boundaries object of a test's ``cu_seqlens`` tensor."""
    return SeqBoundaries.from_tensor(cu)


def _inputs(lengths, ratio=4, h=3, d=5, dtype=torch.float64):
    cu = cu_seqlens_from_lengths(lengths)
    cuc = compressed_cu_seqlens(cu, ratio)
    t, tc = int(cu[-1]), int(cuc[-1])
    return (
        torch.randn(t, h, d, dtype=dtype),
        torch.randn(tc, d, dtype=dtype),
        torch.randn(t, h, dtype=dtype),
        cu,
        cuc,
    )


def _loop_scores(q, k, w, ratio, lengths):
    """Per row: list of (global entry, score) over the visible entries, from the formula."""
    out, start, cstart = [], 0, 0
    for n in lengths:
        for t in range(n):
            row = []
            for s in range((t + 1) // ratio):
                dots = q[start + t] @ k[cstart + s]  # [H]
                row.append((cstart + s, float((w[start + t] * torch.relu(dots)).sum())))
            out.append(row)
        start += n
        cstart += n // ratio
    return out


def _expected_topk(row, topk):
    ranked = sorted(row, key=lambda e: (-e[1], e[0]))[:topk]  # descending, ties -> lower index
    ids = [e[0] for e in ranked]
    return ids + [-1] * (topk - len(ids))


@pytest.mark.parametrize("ratio", [4, 8])
def test_scores_match_loop_oracle(ratio):
    q, k, w, cu, cuc = _inputs(LENGTHS, ratio)
    scores = indexer_scores(q, k, w, ratio, _b(cu), chunk_size=7)
    rows = _loop_scores(q, k, w, ratio, LENGTHS)
    assert scores.shape == (sum(LENGTHS), max(n // ratio for n in LENGTHS))
    for t, row in enumerate(rows):
        doc_start = next(int(cuc[i]) for i in range(len(LENGTHS)) if cu[i] <= t < cu[i + 1])
        expect = torch.full((scores.shape[1],), float("-inf"), dtype=torch.float64)
        for g, v in row:
            expect[g - doc_start] = v
        torch.testing.assert_close(scores[t], expect)


@pytest.mark.parametrize("topk", [1, 3, 50])
def test_i1_topk_is_best_visible(topk):
    q, k, w, cu, _cuc = _inputs(LENGTHS)
    idx, vals = indexer_topk(q, k, w, 4, topk, _b(cu), chunk_size=5)
    assert idx.dtype == torch.int32 and idx.shape == (sum(LENGTHS), topk)
    rows = _loop_scores(q, k, w, 4, LENGTHS)  # global entry ids
    positions = [t for n in LENGTHS for t in range(n)]
    for r, (ent, t) in enumerate(zip(rows, positions)):
        assert idx[r].tolist() == _expected_topk(ent, topk)
        assert int((idx[r] == -1).sum()) == max(0, topk - (t + 1) // 4)  # I1 count of -1
        sel = [v for _, v in sorted(ent, key=lambda e: (-e[1], e[0]))[:topk]]
        torch.testing.assert_close(vals[r, : len(sel)], torch.tensor(sel, dtype=torch.float64))
        assert torch.isneginf(vals[r, len(sel) :]).all()


def test_i6_ties_go_to_the_lower_index():
    # one head, one channel, q = w = 1: I[t, s] = relu(k[s]) with k drawn from {-1, 0, 0, 0, 0.5, 1}
    lengths = [37, 100, 64]
    cu = cu_seqlens_from_lengths(lengths)
    cuc = compressed_cu_seqlens(cu, 4)
    t, tc = int(cu[-1]), int(cuc[-1])
    pool = torch.tensor([-1.0, 0.0, 0.0, 0.0, 0.5, 1.0], dtype=torch.float64)
    k = pool[torch.randint(0, 6, (tc,))][:, None]
    q = torch.ones(t, 1, 1, dtype=torch.float64)
    w = torch.ones(t, 1, dtype=torch.float64)
    dense = indexer_scores(q, k, w, 4, _b(cu))  # [T, C], -inf invisible
    for topk in (3, 8, 30):
        ref = torch.sort(dense, dim=1, descending=True, stable=True)  # lowest index first among equals
        cols = torch.where(torch.isneginf(ref.values[:, :topk]), -1, ref.indices[:, :topk])
        doc = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
        expect = torch.where(cols >= 0, cols + cuc[doc][:, None], -1)
        if expect.shape[1] < topk:
            expect = torch.nn.functional.pad(expect, (0, topk - expect.shape[1]), value=-1)
        for chunk in (None, 1, 13):
            idx, _ = indexer_topk(q, k, w, 4, topk, _b(cu), chunk_size=chunk)
            assert torch.equal(idx.long(), expect.long()), (topk, chunk)


def test_i4_hadamard_rotation_leaves_scores_unchanged():
    q, k, w, cu, _cuc = _inputs([37, 64], h=2, d=8)
    had = torch.ones(1, 1, dtype=torch.float64)
    while had.shape[0] < 8:
        had = torch.cat((torch.cat((had, had), 1), torch.cat((had, -had), 1)), 0)
    had = had / 8**0.5  # orthonormal Sylvester-Hadamard
    a = indexer_scores(q, k, w, 4, _b(cu))
    b = indexer_scores(q @ had.T, k @ had.T, w, 4, _b(cu))
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    ia, _ = indexer_topk(q, k, w, 4, 5, _b(cu))
    ib, _ = indexer_topk(q @ had.T, k @ had.T, w, 4, 5, _b(cu))
    assert torch.equal(ia, ib)


def test_i2_short_sequences_make_attention_independent_of_the_indexer():
    ratio, topk, window, h, d = 4, 4, 3, 2, 8
    lengths = [16, 7, 1, 0, 12]  # every T <= ratio * topk
    q_idx, k_idx, w_idx, cu, cuc = _inputs(lengths, ratio)
    t, tc = int(cu[-1]), int(cuc[-1])
    q = torch.randn(t, h, d, dtype=torch.float64)
    kv_all = torch.randn(t + tc, d, dtype=torch.float64)
    sink = torch.randn(h, dtype=torch.float64)
    win = window_indices(_b(cu), window)
    dense = sparse_attn(
        q, kv_all, sink, attention_indices(win, visible_compressed_indices(_b(cu), ratio), t), 0.3
    )
    for _ in range(2):  # two unrelated indexers
        sel, _ = indexer_topk(
            torch.randn_like(q_idx), torch.randn_like(k_idx), torch.randn_like(w_idx), ratio, topk, _b(cu)
        )
        sparse = sparse_attn(q, kv_all, sink, attention_indices(win, sel, t), 0.3)
        torch.testing.assert_close(sparse[0], dense[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(sparse[1], dense[1], rtol=1e-12, atol=1e-12)


def test_thd_equals_sbhd_and_single_document():
    s, b, h, d, ratio, topk = 37, 3, 2, 4, 4, 5
    q = torch.randn(s, b, h, d, dtype=torch.float64)
    k = torch.randn(s // ratio, b, d, dtype=torch.float64)
    w = torch.randn(s, b, h, dtype=torch.float64)
    dense = indexer_scores_sbhd(q, k, w, ratio)
    idx, vals = indexer_topk_sbhd(q, k, w, ratio, topk)
    assert dense.shape == (s, b, s // ratio) and idx.shape == (s, b, topk)
    for i in range(b):
        cu = cu_seqlens_from_lengths([s])
        torch.testing.assert_close(
            dense[:, i], indexer_scores(q[:, i], k[:, i], w[:, i], ratio, _b(cu)), rtol=0, atol=0
        )
        i1, v1 = indexer_topk(q[:, i], k[:, i], w[:, i], ratio, topk, _b(cu))
        assert torch.equal(idx[:, i], i1)
        torch.testing.assert_close(vals[:, i], v1, rtol=0, atol=0)
    # packed documents == each document alone (empty document inside the pack)
    lengths = [5, 0, 37, 9]
    q2, k2, w2, cu2, cuc2 = _inputs(lengths)
    idx2, _ = indexer_topk(q2, k2, w2, 4, topk, _b(cu2))
    for j, n in enumerate(lengths):
        r0, c0 = int(cu2[j]), int(cuc2[j])
        cu1 = cu_seqlens_from_lengths([n])
        one, _ = indexer_topk(
            q2[r0 : r0 + n],
            k2[c0 : c0 + n // 4],
            w2[r0 : r0 + n],
            4,
            topk,
            _b(cu1),
        )
        assert torch.equal(idx2[r0 : r0 + n], torch.where(one >= 0, one + c0, -1))


def test_gradcheck_scores_topk_and_scores_at():
    lengths = [9, 0, 6]
    q, k, w, cu, _cuc = _inputs(lengths, h=2, d=3)
    ins = [x.clone().requires_grad_() for x in (q, k, w)]

    def dense(a, b, c):
        out = indexer_scores(a, b, c, 4, _b(cu), chunk_size=2)
        return torch.where(torch.isneginf(out), 0.0, out)

    def topk(a, b, c):
        _, vals = indexer_topk(a, b, c, 4, 3, _b(cu), chunk_size=2)
        return torch.where(torch.isneginf(vals), 0.0, vals)

    sel, _ = indexer_topk(q, k, w, 4, 3, _b(cu))

    def at(a, b, c):
        out = indexer_scores_at(a, b, c, sel, chunk_size=3)
        return torch.where(torch.isneginf(out), 0.0, out)

    for fn in (dense, topk, at):
        assert torch.autograd.gradcheck(fn, ins)


@pytest.mark.parametrize("lengths", [[3, 0, 2], [], [1]], ids=["short_docs", "no_docs", "one_token"])
def test_empty_compressed_buffer(lengths):
    """Tc = 0 (every document shorter than the ratio): all -1 / -inf, zero gradients, no IndexError."""
    q, k, w, cu, _cuc = _inputs(lengths)
    assert k.shape[0] == 0
    ins = [x.clone().requires_grad_() for x in (q, k, w)]
    for fn in (indexer_topk, indexer_topk_ref):
        idx, vals = fn(*ins, 4, 3, _b(cu))
        assert idx.shape == (len(q), 3) and idx.dtype == torch.int32 and (idx == -1).all()
        assert vals.shape == (len(q), 3) and torch.isneginf(vals).all()
        grads = torch.autograd.grad(torch.where(idx >= 0, vals, 0.0).sum(), ins, allow_unused=True)
        for g, x in zip(grads, ins, strict=True):
            assert g is None or (g.shape == x.shape and (g == 0).all())
    at = indexer_scores_at(*ins, torch.full((len(q), 2), -1, dtype=torch.int32))
    assert at.shape == (len(q), 2) and torch.isneginf(at).all()
    dense = indexer_scores(*ins, 4, _b(cu))
    assert dense.shape == (len(q), 0)


def test_chunking_bounds_the_largest_intermediate(largest_allocation):
    # one long document: T = 512, HI = 8, C = 128, DI = 16: [T, HI, C] would be 524288 elements
    t, h, d, ratio, topk, chunk = 512, 8, 16, 4, 8, 16
    q, k, w, cu, _cuc = _inputs([t], ratio, h=h, d=d, dtype=torch.float32)
    c = t // ratio
    ins = [x.requires_grad_() for x in (q, k, w)]
    full = t * h * c
    # everything allocated is an input/output-sized tensor or one chunk's [chunk, HI, C] block
    bound = max(t * h * d, t * topk, t * c, chunk * h * c)
    with largest_allocation() as rec:
        _, vals = indexer_topk(*ins, ratio, topk, _b(cu), chunk_size=chunk)
        vals[torch.isfinite(vals)].sum().backward()
    assert rec.ops > 100 and k.grad is not None
    assert rec.largest <= bound < full // 4, (rec.largest, bound, full)
    with largest_allocation() as rec:
        dense = indexer_scores(*ins, ratio, _b(cu), chunk_size=chunk)
        dense[torch.isfinite(dense)].sum().backward()
    assert rec.largest <= bound < full // 4, (rec.largest, bound, full)
    # the recorder does see a full [T, HI, C] block when the whole document is one chunk
    with largest_allocation() as rec:
        indexer_scores(*ins, ratio, _b(cu), chunk_size=t)
    assert rec.largest >= full
    # without chunk_size the automatic chunk follows the 2^24-element budget
    with largest_allocation() as rec:
        indexer_topk(*ins, ratio, topk, _b(cu))
    assert rec.largest <= max(bound, 1 << 24)


def test_bad_inputs():
    q, k, w, cu, _cuc = _inputs([8, 5])
    with pytest.raises(ValueError, match="compressed entries"):
        indexer_topk(q, k[:-1], w, 4, 2, _b(cu))
    with pytest.raises(ValueError, match="topk"):
        indexer_topk(q, k, w, 4, 0, _b(cu))
    with pytest.raises(ValueError, match="weights"):
        indexer_topk(q, k, w[:, :1], 4, 2, _b(cu))
    with pytest.raises(ValueError, match="max_entries"):
        indexer_scores(q, k, w, 4, _b(cu), max_entries=1)
    with pytest.raises(ValueError, match="chunk_size"):
        indexer_scores(q, k, w, 4, _b(cu), chunk_size=0)
    with pytest.raises(ValueError, match="backend"):
        indexer_topk(q, k, w, 4, 2, _b(cu), backend="cuda")


def test_torch_topk_tie_break_for_hf_cpu_parity():
    lengths = [37, 64]
    q, k, w, cu, cuc = _inputs(lengths)
    q, k = q.abs(), k.abs()  # positive dots: no ReLU zeros, so no exact ties; both rules agree exactly
    a = indexer_topk(q, k, w, 4, 5, _b(cu))
    b = indexer_topk_ref(q, k, w, 4, 5, _b(cu), tie_break="torch_topk")
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
    # tie-heavy rows: exactly torch.topk over each document's full masked row
    pool = torch.tensor([-1.0, 0.0, 0.0, 0.0, 0.5, 1.0], dtype=torch.float64)
    k1 = pool[torch.randint(0, 6, (int(cuc[-1]),))][:, None]
    q1, w1 = (
        torch.ones(sum(lengths), 1, 1, dtype=torch.float64),
        torch.ones(sum(lengths), 1, dtype=torch.float64),
    )
    idx, _ = indexer_topk_ref(q1, k1, w1, 4, 6, _b(cu), chunk_size=7, tie_break="torch_topk")
    for j, n in enumerate(lengths):
        r0, c0, n_c = int(cu[j]), int(cuc[j]), n // 4
        row = indexer_scores(
            q1[r0 : r0 + n],
            k1[c0 : c0 + n_c],
            w1[r0 : r0 + n],
            4,
            SeqBoundaries.from_host([0, n]),
        )
        vals, cols = torch.topk(row, min(6, n_c), dim=1)
        expect = torch.where(torch.isneginf(vals), -1, cols + c0)
        assert torch.equal(idx[r0 : r0 + n, : expect.shape[1]].long(), expect)
    with pytest.raises(ValueError, match="tie_break"):
        indexer_topk_ref(q, k, w, 4, 5, _b(cu), tie_break="random")


def test_dtype_policy():
    q, k, w, cu, _cuc = _inputs([37, 9], dtype=torch.float32)
    dense = indexer_scores(q.bfloat16(), k.bfloat16(), w.bfloat16(), 4, _b(cu))
    idx, vals = indexer_topk(q.bfloat16(), k.bfloat16(), w.bfloat16(), 4, 3, _b(cu), backend="reference")
    assert dense.dtype == torch.float32 and vals.dtype == torch.float32 and idx.dtype == torch.int32
