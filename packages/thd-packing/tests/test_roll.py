import pytest
import torch
from _thd_packing_helpers import naive_roll_left
from hypothesis import given
from hypothesis import strategies as st

from thd_packing import PackedSeqs, roll_left


def test_upstream_example_padded_boundaries():
    # two documents of 7 and 11 tokens padded to 8 and 12 (the upstream CP=2 example, on one rank)
    ps = PackedSeqs.from_lengths([7, 11], [8, 12])
    x = torch.arange(20)
    out = roll_left(x, ps, fill_value=-1)
    expected = list(range(1, 8)) + [-1] + list(range(9, 20)) + [-1]
    assert out.tolist() == expected


def test_empty_documents_and_tail():
    cu = torch.tensor([0, 0, 3, 3, 3, 5])
    x = torch.arange(7) + 10
    out = roll_left(x, cu, fill_value=0)
    assert out.tolist() == [11, 12, 0, 14, 0, 0, 0]


def test_bool_fill_true_for_padding_masks():
    ps = PackedSeqs.from_lengths([2, 2])
    mask = torch.tensor([False, False, False, True])
    assert roll_left(mask, ps, fill_value=True).tolist() == [False, True, True, True]


@given(
    lengths=st.lists(st.integers(0, 6), min_size=0, max_size=6),
    tail=st.integers(0, 3),
    shifts=st.integers(1, 3),
    dim=st.sampled_from([0, 1, -1]),
)
def test_matches_naive_reference(lengths, tail, shifts, dim):
    ps = PackedSeqs.from_lengths(lengths, total_tokens=sum(lengths) + tail)
    t = ps.total_tokens
    x = torch.randn(t, 3)
    ref = naive_roll_left(x, ps.cu_seqlens_padded, shifts, fill=-5.0)
    if dim == 0:
        out = roll_left(x, ps, shifts=shifts, fill_value=-5.0)
    else:
        out = roll_left(x.T.contiguous(), ps, shifts=shifts, fill_value=-5.0, dim=dim).T
    assert torch.equal(out, ref)


def test_gradient_flows_only_within_documents():
    ps = PackedSeqs.from_lengths([3, 2])
    x = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda v: roll_left(v, ps, fill_value=0.0), (x,))
    roll_left(x, ps).sum().backward()
    # row 0 and row 3 (document starts) are never read
    assert x.grad[:, 0].tolist() == [0.0, 1.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize(
    ("shifts", "x", "match"),
    [(0, torch.zeros(5), "positive"), (1, torch.zeros(4), "cu_seqlens_padded")],
)
def test_errors(shifts, x, match):
    with pytest.raises(ValueError, match=match):
        roll_left(x, PackedSeqs.from_lengths([2, 3]), shifts=shifts)


def test_unvalidated_roll_equals_validated():
    """``validate=False`` (static packs under CUDA graphs: no host read of the boundaries) rolls identically."""
    p = PackedSeqs.from_lengths([3, 0, 4, 1], [4, 0, 6, 1], total_tokens=14)
    x = torch.arange(14.0).reshape(1, 14)
    for b in (p, p.cu_seqlens_padded):
        assert torch.equal(roll_left(x, b, dim=-1, validate=False), roll_left(x, b, dim=-1))
