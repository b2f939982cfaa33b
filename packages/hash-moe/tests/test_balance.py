"""Sequence-wise balance loss and the selection-bias update rule (the reductions over a process group are tested
in test_ep_parity.py, inside its gloo run)."""

import pytest
import torch

from dsv4_testkit import assert_close_to_ref
from hash_moe import (
    RouterConfig,
    sequence_balance_loss,
    sequence_ids_from_cu_seqlens,
    tokens_per_expert,
    topk_route,
    update_selection_bias_,
)


def _loss_direct(scores, experts, seqs, num_experts, topk, alpha):
    """V3 definition written per sequence with Python loops (fp64)."""
    losses = []
    for toks in seqs:
        if not toks:
            continue
        t = len(toks)
        f = torch.zeros(num_experts, dtype=torch.float64)
        p = torch.zeros(num_experts, dtype=torch.float64)
        for i in toks:
            for e in experts[i].tolist():
                f[e] += num_experts / (topk * t)
            p = p + scores[i] / scores[i].sum() / t
        losses.append(alpha * (f * p).sum())
    return torch.stack(losses).mean()


def test_balance_loss_matches_definition_with_padding_and_sequences():
    torch.manual_seed(0)
    n, e, k = 23, 8, 3
    cfg = RouterConfig(num_experts=e, topk=k)
    logits = torch.randn(n, e, dtype=torch.float64, requires_grad=True)
    valid = torch.rand(n) > 0.25
    seq = torch.randint(0, 4, (n,))
    seq[seq == 3] = 2  # sequence 3 is empty: left out of the mean
    r = topk_route(logits, cfg, valid=valid)
    got = sequence_balance_loss(
        r.scores, r.experts, coeff=1e-2, sequence_ids=seq, num_sequences=4, valid=valid
    )
    seqs = [[i for i in range(n) if int(seq[i]) == j and bool(valid[i])] for j in range(4)]
    want = _loss_direct(r.scores, r.experts, seqs, e, k, 1e-2)
    assert_close_to_ref("loss", got, want, atol=1e-14)
    (g1,) = torch.autograd.grad(got, logits, retain_graph=True)
    (g2,) = torch.autograd.grad(want, logits)
    assert_close_to_ref("dlogits", g1, g2, atol=1e-14)


def test_balance_loss_ignores_padding_rows_and_uniform_value():
    torch.manual_seed(1)
    e = 4
    scores = torch.rand(6, e, dtype=torch.float64)
    experts = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3], [1, 0], [0, 1]])
    valid = torch.tensor([True, True, True, True, False, False])
    a = sequence_balance_loss(scores, experts, coeff=1.0, valid=valid)
    b = sequence_balance_loss(scores[:4], experts[:4], coeff=1.0)
    torch.testing.assert_close(a, b)
    # perfectly uniform scores and loads: L = α Σ_e (1)(1/E) = α
    uni = sequence_balance_loss(torch.ones(4, e, dtype=torch.float64), experts[:4], coeff=0.5)
    torch.testing.assert_close(uni, torch.tensor(0.5, dtype=torch.float64))


def test_sequence_ids_from_cu_seqlens():
    ids = sequence_ids_from_cu_seqlens(torch.tensor([0, 3, 3, 7]), 7)
    assert ids.tolist() == [0, 0, 0, 2, 2, 2, 2]  # the empty document 1 holds no token
    with pytest.raises(ValueError, match="cu_seqlens"):
        sequence_ids_from_cu_seqlens(torch.tensor([0, 3, 6]), 7)


def test_tokens_per_expert_ignores_padding():
    experts = torch.tensor([[0, 1], [1, 2], [3, 0]])
    assert tokens_per_expert(experts, 5, torch.tensor([True, False, True])).tolist() == [2, 1, 0, 1, 0]


def test_bias_update_rule():
    bias = torch.zeros(2, 4)
    load = torch.tensor([[1.0, 5.0, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0]])
    update_selection_bias_(bias, load, 0.001)
    torch.testing.assert_close(bias, torch.tensor([[0.001, -0.001, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="speed"):
        update_selection_bias_(bias, load, 0.0)
    with pytest.raises(ValueError, match="shape"):
        update_selection_bias_(bias, load[0], 0.1)
