import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from thd_packing import PackedSeqs, StaticShapeConfig, pad_to_static_shape, unpad_static_shape


def _pack(lengths, extra, tail):
    padded = [n + e for n, e in zip(lengths, extra)]
    return PackedSeqs.from_lengths(lengths, padded, total_tokens=sum(padded) + tail)


@given(
    lengths=st.lists(st.integers(0, 7), min_size=0, max_size=6),
    extra=st.lists(st.integers(0, 2), min_size=6, max_size=6),
    tail=st.integers(0, 3),
    spare_tokens=st.integers(0, 6),
    spare_seqs=st.integers(0, 3),
    dummy=st.booleans(),
    feat=st.integers(1, 3),
)
def test_round_trip_and_static_shapes(lengths, extra, tail, spare_tokens, spare_seqs, dummy, feat):
    ps = _pack(lengths, extra, tail)
    t = ps.total_tokens
    cap = max(t + spare_tokens, 1)
    max_num_seqs = max(ps.num_seqs + 1 + spare_seqs, 1)
    tokens = torch.arange(t, dtype=torch.int64) + 100
    hidden = torch.randn(t, feat)
    mask = torch.ones(t, dtype=torch.bool)
    cfg = StaticShapeConfig(cap, max_num_seqs, append_dummy_seq=dummy)
    sp = pad_to_static_shape(
        ps, {"tokens": tokens, "hidden": hidden, "mask": mask}, cfg, pad_values={"tokens": -1, "mask": False}
    )
    # static shapes
    assert sp.packed.total_tokens == cap and sp.packed.max_seqlen == cap
    assert sp.packed.cu_seqlens.numel() == sp.packed.cu_seqlens_padded.numel() == max_num_seqs + 1
    assert sp.tensors["tokens"].shape == (cap,) and sp.tensors["hidden"].shape == (cap, feat)
    assert sp.padding_mask.shape == (cap,)
    # one static boundaries object: the padded documents on the device, the row capacity on the host
    assert (
        sp.bounds.is_static and sp.bounds.total == cap and sp.bounds.cu_seqlens is sp.packed.cu_seqlens_padded
    )
    assert sp.bounds.max_entries(4) == cap // 4
    # the dummy covers the whole tail, so every row belongs to a document
    end = int(ps.cu_seqlens_padded[-1])
    if dummy:
        assert int(sp.packed.cu_seqlens_padded[-1]) == cap
        assert (sp.packed.seq_ids >= 0).all() or cap == 0
    else:
        assert int(sp.packed.cu_seqlens_padded[-1]) == end
    # padding mask: exactly the non-real rows
    assert int((~sp.padding_mask).sum()) == ps.num_real_tokens
    assert torch.equal(sp.padding_mask[:t], ps.padding_mask())
    assert (sp.tensors["tokens"][t:] == -1).all() and not sp.tensors["mask"][t:].any()
    # real documents keep their boundaries and positions
    assert torch.equal(sp.packed.cu_seqlens_padded[: ps.num_seqs + 1], ps.cu_seqlens_padded)
    assert torch.equal(sp.packed.position_ids[:end], ps.position_ids[:end])
    # inverse
    back, tensors = unpad_static_shape(sp)
    assert back.same_as(ps)
    assert torch.equal(tensors["tokens"], tokens) and torch.equal(tensors["hidden"], hidden)
    assert torch.equal(tensors["mask"], mask)


def test_dummy_sequence_example():
    ps = PackedSeqs.from_lengths([3, 5], [4, 8])
    sp = pad_to_static_shape(ps, {}, StaticShapeConfig(token_capacity=16, max_num_seqs=4))
    assert sp.packed.cu_seqlens.tolist() == [0, 3, 8, 12, 12]
    assert sp.packed.cu_seqlens_padded.tolist() == [0, 4, 12, 16, 16]
    assert sp.packed.position_ids[12:].tolist() == [0, 1, 2, 3]
    assert sp.info.num_tokens == 12 and sp.info.num_seqs == 2 and sp.info.max_seqlen == 8


def test_exact_capacity_needs_no_dummy():
    ps = PackedSeqs.from_lengths([4, 4])
    sp = pad_to_static_shape(ps, {}, StaticShapeConfig(8, 2))
    assert sp.packed.cu_seqlens.tolist() == [0, 4, 8]


def test_tail_rows_along_other_dim():
    ps = PackedSeqs.from_lengths([2, 1])
    x = torch.arange(6.0).reshape(2, 3)  # [B=2, T=3]
    sp = pad_to_static_shape(ps, {"x": x}, StaticShapeConfig(5, 3), dim=1, pad_values={"x": 7.0})
    assert sp.tensors["x"].shape == (2, 5) and (sp.tensors["x"][:, 3:] == 7).all()
    _, t = unpad_static_shape(sp, dim=1)
    assert torch.equal(t["x"], x)


@pytest.mark.parametrize(
    ("cap", "max_seqs", "tensors", "pad_values", "match"),
    [
        (4, 4, {}, None, "token_capacity is 4"),
        (12, 2, {}, None, "plus the dummy"),
        (8, 4, {"x": torch.zeros(7)}, None, "expected 8"),
        (8, 4, {}, {"y": 0}, "not passed"),
    ],
)
def test_errors(cap, max_seqs, tensors, pad_values, match):
    ps = PackedSeqs.from_lengths([3, 5])
    with pytest.raises(ValueError, match=match):
        pad_to_static_shape(ps, tensors, StaticShapeConfig(cap, max_seqs), pad_values=pad_values)


def test_bad_config():
    with pytest.raises(ValueError, match="token_capacity"):
        StaticShapeConfig(0, 2)
    with pytest.raises(ValueError, match="max_num_seqs"):
        StaticShapeConfig(4, 0)
