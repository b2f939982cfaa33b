"""Indexer KL loss: teacher vs a loop oracle (full denominator), oracle I5, detached teacher (I3), dense vs sparse,
underflow in the log domain, empty rows, THD vs SBHD, chunked memory bound, gradients."""

import math

import pytest
import torch

from csa_kernels import (
    attention_indices,
    indexer_loss,
    indexer_loss_ref,
    indexer_loss_sbhd,
    indexer_scores,
    indexer_teacher_ref,
    indexer_topk,
    sparse_attn,
    visible_compressed_indices,
    window_indices,
)
from dsv4_primitives.varlen import SeqBoundaries, compressed_cu_seqlens, cu_seqlens_from_lengths

LENGTHS = [1, 3, 7, 8, 0, 16, 37]


def _case(lengths, ratio=4, window=3, h=3, d=6, hi=2, di=4, dtype=torch.float64):
    cu = cu_seqlens_from_lengths(lengths)
    cuc = compressed_cu_seqlens(cu, ratio)
    t, tc = int(cu[-1]), int(cuc[-1])
    q = torch.randn(t, h, d, dtype=dtype)
    kv_all = torch.randn(t + tc, d, dtype=dtype)
    sink = torch.randn(h, dtype=dtype)
    bounds = SeqBoundaries.from_tensor(cu)
    vis = visible_compressed_indices(bounds, ratio)
    win = window_indices(bounds, window)
    _, lse = sparse_attn(q, kv_all, sink, attention_indices(win, vis, t), d**-0.5)
    comp = torch.where(vis >= 0, vis + t, -1)  # rows of kv_all
    q_idx, k_idx, w_idx = (
        torch.randn(t, hi, di, dtype=dtype),
        torch.randn(tc, di, dtype=dtype),
        torch.randn(t, hi, dtype=dtype),
    )
    return dict(
        cu=cu,
        bounds=bounds,
        cuc=cuc,
        t=t,
        q=q,
        kv_all=kv_all,
        sink=sink,
        lse=lse,
        comp=comp,
        win=win,
        idx=(q_idx, k_idx, w_idx),
    )


def _loop_teacher(q, kv_all, lse, comp, scale):
    t_, h_, _ = q.shape
    out = torch.zeros(comp.shape, dtype=torch.float64)
    for t in range(t_):
        slots = [j for j in range(comp.shape[1]) if comp[t, j] >= 0]
        mass = {
            j: sum(
                math.exp(float(q[t, h] @ kv_all[comp[t, j]]) * scale - float(lse[t, h])) for h in range(h_)
            )
            for j in slots
        }
        total = sum(mass.values())
        for j in slots:
            out[t, j] = mass[j] / total
    return out


def test_teacher_matches_loop_oracle_with_full_denominator():
    c = _case(LENGTHS)
    scale = c["q"].shape[2] ** -0.5
    log_p = indexer_teacher_ref(c["q"], c["kv_all"], c["lse"], c["comp"], scale)
    torch.testing.assert_close(
        torch.exp(log_p), _loop_teacher(c["q"], c["kv_all"], c["lse"], c["comp"], scale)
    )
    # a per-head change of the denominator (e.g. the window's mass) reweights the heads: the teacher changes
    lse2 = c["lse"].clone()
    lse2[:, 0] += 2.0
    assert not torch.allclose(
        torch.exp(indexer_teacher_ref(c["q"], c["kv_all"], lse2, c["comp"], scale)), torch.exp(log_p)
    )


def test_i5_teacher_normalised_kl_nonnegative_and_zero_at_teacher():
    c = _case(LENGTHS)
    scale = c["q"].shape[2] ** -0.5
    log_p = indexer_teacher_ref(c["q"], c["kv_all"], c["lse"], c["comp"], scale)
    has = (c["comp"] >= 0).any(1)
    torch.testing.assert_close(torch.exp(log_p)[has].sum(1), torch.ones(int(has.sum()), dtype=torch.float64))
    scores = indexer_scores(*c["idx"], 4, c["bounds"])
    loss, per_row = indexer_loss(c["q"], c["kv_all"], c["sink"], c["lse"], c["comp"], scores, scale)
    assert (per_row >= 0).all() and loss > 0
    assert torch.equal(per_row[~has], torch.zeros(int((~has).sum()), dtype=torch.float64))
    torch.testing.assert_close(loss, per_row[has].mean())
    # student == teacher (up to a per-row constant) -> KL = 0
    student = torch.where(torch.isneginf(log_p), 0.0, log_p + 3.0)
    loss0, per_row0 = indexer_loss(c["q"], c["kv_all"], c["sink"], c["lse"], c["comp"], student, scale)
    assert per_row0.abs().max() < 1e-12 and abs(float(loss0)) < 1e-12


def test_only_index_scores_receive_gradient():
    c = _case(LENGTHS)
    scale = c["q"].shape[2] ** -0.5
    q, kv, lse, sink = (c[n].clone().requires_grad_() for n in ("q", "kv_all", "lse", "sink"))
    q_idx, k_idx, w_idx = (x.clone().requires_grad_() for x in c["idx"])
    scores = indexer_scores(q_idx, k_idx, w_idx, 4, c["bounds"])
    loss, _ = indexer_loss(q, kv, sink, lse, c["comp"], scores, scale)
    loss.backward()
    assert q.grad is None and kv.grad is None and lse.grad is None and sink.grad is None
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in (q_idx, k_idx, w_idx))
    # analytic gradient: (softmax(scores) - teacher) / n_rows on valid slots
    s = scores.detach().requires_grad_()
    loss, _ = indexer_loss(c["q"], c["kv_all"], c["sink"], c["lse"], c["comp"], s, scale)
    (g,) = torch.autograd.grad(loss, s)
    valid = c["comp"] >= 0
    has = valid.any(1)
    p = torch.exp(indexer_teacher_ref(c["q"], c["kv_all"], c["lse"], c["comp"], scale))
    r = torch.softmax(s.detach().masked_fill(~valid, float("-inf")), 1).nan_to_num(0.0)
    expect = torch.where(has[:, None], r - p, 0.0) / int(has.sum())
    torch.testing.assert_close(g, expect)


def test_gradcheck_index_scores():
    c = _case([9, 0, 6])
    scale = c["q"].shape[2] ** -0.5
    scores = torch.randn(c["comp"].shape, dtype=torch.float64, requires_grad=True)

    def fn(s):
        loss, per_row = indexer_loss(c["q"], c["kv_all"], c["sink"], c["lse"], c["comp"], s, scale)
        return loss, per_row

    assert torch.autograd.gradcheck(fn, (scores,))


def test_sparse_equals_dense_when_everything_visible_is_selected():
    c = _case([16, 7, 12])  # T <= ratio * topk: the top-k holds every visible entry
    scale = c["q"].shape[2] ** -0.5
    dense_scores = indexer_scores(*c["idx"], 4, c["bounds"])
    dense, _ = indexer_loss(c["q"], c["kv_all"], c["sink"], c["lse"], c["comp"], dense_scores, scale)
    sel, sel_scores = indexer_topk(*c["idx"], 4, 4, c["bounds"])
    comp = torch.where(sel >= 0, sel + c["t"], -1)
    sparse, _ = indexer_loss(c["q"], c["kv_all"], c["sink"], c["lse"], comp, sel_scores, scale)
    torch.testing.assert_close(sparse, dense)
    # with fewer slots than visible entries the teacher is renormalised on the selected set
    sel2, sc2 = indexer_topk(*c["idx"], 4, 2, c["bounds"])
    comp2 = torch.where(sel2 >= 0, sel2 + c["t"], -1)
    log_p = indexer_teacher_ref(c["q"], c["kv_all"], c["lse"], comp2, scale)
    has = (comp2 >= 0).any(1)
    torch.testing.assert_close(torch.exp(log_p)[has].sum(1), torch.ones(int(has.sum()), dtype=torch.float64))
    loss2, _ = indexer_loss(c["q"], c["kv_all"], c["sink"], c["lse"], comp2, sc2, scale)
    assert torch.isfinite(loss2)


def test_underflow_safe_in_log_domain():
    c = _case([37], dtype=torch.float32)
    scale = c["q"].shape[2] ** -0.5
    lse = c["lse"] + 150.0  # window mass dominates: exp(z - lse) underflows fp32 for every compressed slot
    log_p = indexer_teacher_ref(c["q"], c["kv_all"], lse, c["comp"], scale)
    ref = _loop_teacher(
        c["q"].double(), c["kv_all"].double(), c["lse"].double(), c["comp"], scale
    )  # shift cancels
    torch.testing.assert_close(torch.exp(log_p).double(), ref, rtol=1e-4, atol=1e-6)
    scores = torch.randn(c["comp"].shape)
    loss, per_row = indexer_loss(c["q"], c["kv_all"], c["sink"], lse, c["comp"], scores, scale)
    assert torch.isfinite(loss) and torch.isfinite(per_row).all()


def test_rows_without_entries_and_all_invalid():
    c = _case([3, 2])  # no document reaches one entry
    scores = torch.randn(c["comp"].shape[0], 0, dtype=torch.float64, requires_grad=True)
    loss, per_row = indexer_loss(c["q"], c["kv_all"], c["sink"], c["lse"], c["comp"], scores, 0.3)
    assert float(loss.detach()) == 0.0 and torch.equal(per_row, torch.zeros(5, dtype=torch.float64))
    loss.backward()
    comp = torch.full((5, 3), -1, dtype=torch.int32)
    s = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    loss, per_row = indexer_loss(c["q"], c["kv_all"], c["sink"], c["lse"], comp, s, 0.3)
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.equal(s.grad, torch.zeros_like(s))


def test_thd_equals_sbhd():
    s, b, h, d, ratio = 37, 2, 3, 6, 4
    sc = s // ratio
    q = torch.randn(s, b, h, d, dtype=torch.float64)
    kv_all = torch.randn(s + sc, b, d, dtype=torch.float64)
    sink = torch.randn(h, dtype=torch.float64)
    lse = torch.randn(s, b, h, dtype=torch.float64) + 3
    vis = visible_compressed_indices(SeqBoundaries.from_lengths([s]), ratio)
    comp = torch.where(vis >= 0, vis + s, -1)[:, None, :].expand(s, b, sc).contiguous()  # local rows
    scores = torch.randn(s, b, sc, dtype=torch.float64)
    loss, per_row = indexer_loss_sbhd(q, kv_all, sink, lse, comp, scores, 0.4)
    for i in range(b):
        _, pr = indexer_loss(q[:, i], kv_all[:, i], sink, lse[:, i], comp[:, i], scores[:, i], 0.4)
        torch.testing.assert_close(per_row[:, i], pr, rtol=0, atol=0)
    has = (comp >= 0).any(2)
    torch.testing.assert_close(loss, per_row[has].mean())


def test_teacher_chunking_bounds_memory(largest_allocation):
    t, h, d, kc, chunk = 256, 8, 16, 64, 8
    q = torch.randn(t, h, d)
    kv_all = torch.randn(t + kc, d)
    lse = torch.randn(t, h) + 5
    comp = (torch.arange(kc)[None, :] + t).expand(t, kc).to(torch.int32).contiguous()
    scores = torch.randn(t, kc, requires_grad=True)
    bound = max(t * kc, chunk * kc * max(d, h), (t + kc) * d, t * h * d)
    # unchunked (the default budget of 2^24 elements covers all 256 rows): [T, Kc, D] gathered rows appear
    with largest_allocation() as rec:
        indexer_loss_ref(q, kv_all, torch.zeros(h), lse, comp, scores, 0.25)
    assert rec.largest >= t * kc * d
    # chunked: nothing larger than the [T, Kc] outputs / inputs / one chunk, in forward and backward
    with largest_allocation() as rec:
        loss, _ = indexer_loss_ref(q, kv_all, torch.zeros(h), lse, comp, scores, 0.25, chunk_size=chunk)
        loss.backward()
    assert scores.grad is not None
    assert rec.largest <= bound < t * kc * d


def test_bad_inputs():
    c = _case([8, 5])
    scale = 0.3
    s = torch.zeros(c["comp"].shape, dtype=torch.float64)
    with pytest.raises(ValueError, match="lse"):
        indexer_loss(c["q"], c["kv_all"], c["sink"], c["lse"][:, :1], c["comp"], s, scale)
    with pytest.raises(ValueError, match="index_scores"):
        indexer_loss(c["q"], c["kv_all"], c["sink"], c["lse"], c["comp"], s[:, :1], scale)
    with pytest.raises(ValueError, match="comp_indices"):
        indexer_loss(c["q"], c["kv_all"], c["sink"], c["lse"], c["comp"] + 100, s, scale)
    with pytest.raises(ValueError, match="softmax_scale"):
        indexer_loss(c["q"], c["kv_all"], c["sink"], c["lse"], c["comp"], s, -1.0)
