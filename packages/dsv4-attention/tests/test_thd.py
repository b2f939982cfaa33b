"""Packed THD ``[t, 1, h]`` with ``PackedSeqParams``: documents never see each other, positions restart per document.

THD of one document equals SBHD; a pack equals running each document alone (outputs and every gradient), also with
per-document padding (``cu_seqlens_q_padded``), tail padding and empty documents.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from dsv4_attention import IndexerLossAutoScaler, get_indexer_loss_tracker, token_layout


def _psp(lengths, padded=None):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    kw = {}
    if padded is not None:
        kw["cu_seqlens_q_padded"] = kw["cu_seqlens_kv_padded"] = torch.tensor(
            [0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32
        )
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max(padded or lengths),
        max_seqlen_kv=max(padded or lengths),
        **kw,
    )


def _grads(m):
    return {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in m.named_parameters()
    }


def test_thd_single_document_equals_sbhd(build):
    m = build(4)
    x = torch.randn(37, 1, 64)
    with torch.no_grad():
        y_sbhd, _ = m(x)
        y_thd, _ = m(x, packed_seq_params=_psp([37]))
    torch.testing.assert_close(y_thd, y_sbhd, rtol=0, atol=1e-6)


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_pack_equals_documents_alone(build, ratio):
    """Output rows and all parameter gradients of a pack == sum over per-document SBHD runs (LM loss only)."""
    m = build(ratio)
    lengths = [5, 0, 37, 16] if ratio != 128 else [131, 3, 0, 129]
    xs = [torch.randn(n, 1, 64) for n in lengths]
    ws = [torch.randn(n, 1, 64) for n in lengths]
    IndexerLossAutoScaler.set_loss_scale(0.0)
    try:
        m.zero_grad(set_to_none=True)
        y, _ = m(torch.cat(xs), packed_seq_params=_psp(lengths))
        (y * torch.cat(ws)).sum().backward()
        g_pack = _grads(m)
        m.zero_grad(set_to_none=True)
        ys = []
        for x, w in zip(xs, ws):
            if x.shape[0] == 0:
                continue
            yi, _ = m(x)
            (yi * w).sum().backward()
            ys.append(yi.detach())
        g_docs = _grads(m)
    finally:
        IndexerLossAutoScaler.reset()
    torch.testing.assert_close(y.detach(), torch.cat(ys), rtol=1e-5, atol=1e-5)
    for n in g_pack:
        torch.testing.assert_close(g_pack[n], g_docs[n], rtol=1e-4, atol=1e-5, msg=n)


def test_padded_pack_equals_documents_alone(build):
    """Per-document padding and static tail padding: real rows equal the unpadded documents, the indexer loss is
    the row-weighted mean of the documents' losses, and padding rows never leak into real rows."""
    m = build(4)
    lengths, padded = [21, 6, 18], [24, 8, 18]
    tail = 5
    xs = [torch.randn(n, 1, 64) for n in lengths]
    rows = []
    for x, n, pn in zip(xs, lengths, padded):
        rows += [x, torch.randn(pn - n, 1, 64) * 10]
    rows.append(torch.randn(tail, 1, 64) * 10)
    x_pack = torch.cat(rows)
    tracker = get_indexer_loss_tracker()
    tracker.reset()
    y, _ = m(x_pack, packed_seq_params=_psp(lengths, padded))
    pack_loss = float(tracker.values[0])
    tracker.reset()
    starts = torch.tensor([0, *padded]).cumsum(0).tolist()
    doc_losses, doc_rows = [], []
    for x, n, s in zip(xs, lengths, starts):
        yi, _ = m(x)
        torch.testing.assert_close(y[s : s + n].detach(), yi.detach(), rtol=1e-5, atol=1e-5)
        doc_losses.append(float(tracker.values[0]))
        doc_rows.append(max(n - 3, 0))  # rows with >= 1 visible entry: t_rel >= 3
        tracker.reset()
    expect = sum(lo * r for lo, r in zip(doc_losses, doc_rows)) / sum(doc_rows)
    assert pack_loss == pytest.approx(expect, rel=1e-5)


def test_packed_seqs_input_and_layout():
    """thd_packing.PackedSeqs-like objects are accepted through ``to_packed_seq_params``; positions restart."""

    class _Packs:
        def to_packed_seq_params(self):
            return _psp([3, 0, 4], [4, 0, 4])

    lay = token_layout(torch.zeros(10, 1, 8), _Packs())
    assert lay.qkv_format == "thd"
    assert lay.bounds.cu_seqlens.tolist() == [0, 3, 4, 4, 4, 8, 8, 10]
    assert lay.positions.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 0, 1]
    assert lay.real_rows.tolist() == [True] * 3 + [False] + [True] * 4 + [False] * 2


@pytest.mark.parametrize(
    ("shape", "psp", "match"),
    [
        ((8, 2, 64), _psp([8, 8]), "batch dim 1"),
        ((8, 1, 64), _psp([4, 5]), "cover 9 rows"),
        ((8, 1, 64), PackedSeqParams(qkv_format="bshd", cu_seqlens_q=torch.tensor([0, 8])), "qkv_format"),
        ((8, 1, 64), PackedSeqParams(qkv_format="thd"), "cu_seqlens_q"),
        (
            (8, 1, 64),
            PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=torch.tensor([0, 8]), cu_seqlens_kv=torch.tensor([0, 4])
            ),
            "cu_seqlens_kv == cu_seqlens_q",
        ),
        (
            (8, 1, 64),
            PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 8]), local_cp_size=2),
            "dynamic context parallelism",
        ),
    ],
)
def test_bad_packed_inputs_are_rejected(shape, psp, match):
    with pytest.raises(ValueError, match=match):
        token_layout(torch.zeros(shape), psp)
