import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from thd_packing import PackedSeqs, cu_seqlens_from_lengths


def test_layout_positions_seq_ids_and_padding_mask():
    # docs: 3 real of 4 padded, an empty doc, 5 real of 8 padded; two tail rows
    ps = PackedSeqs.from_lengths([3, 0, 5], [4, 0, 8], total_tokens=14)
    assert ps.cu_seqlens.tolist() == [0, 3, 3, 8]
    assert ps.cu_seqlens_padded.tolist() == [0, 4, 4, 12]
    assert ps.cu_seqlens.dtype == torch.int32 and ps.cu_seqlens_padded.dtype == torch.int32
    assert ps.max_seqlen == 8 and ps.total_tokens == 14 and ps.num_seqs == 3 and ps.num_real_tokens == 8
    assert ps.position_ids[:12].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]
    assert ps.seq_ids.tolist() == [0] * 4 + [2] * 8 + [-1, -1]
    expected_pad = [0, 0, 0, 1] + [0] * 5 + [1] * 3 + [1, 1]
    assert ps.padding_mask().int().tolist() == expected_pad
    assert ps.has_padding_between_seqs


def test_alignment_and_default_padding():
    ps = PackedSeqs.from_lengths([1, 5, 4], alignment=4)
    assert ps.padded_lengths.tolist() == [4, 8, 4]
    plain = PackedSeqs.from_lengths([2, 3])
    assert torch.equal(plain.cu_seqlens, plain.cu_seqlens_padded) and not plain.has_padding_between_seqs
    assert plain.total_tokens == 5 and not plain.padding_mask().any()


def test_no_documents():
    ps = PackedSeqs.from_cu_seqlens([0], total_tokens=3)
    assert ps.num_seqs == 0 and ps.seq_ids.tolist() == [-1, -1, -1] and ps.padding_mask().all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cu_seqlens": [1, 3]}, "start at 0"),
        ({"cu_seqlens": [0, 3, 2]}, "non-decreasing"),
        ({"cu_seqlens": [[0, 1]]}, "1-D"),
        ({"cu_seqlens": torch.tensor([0.0, 1.0])}, "integer"),
        ({"cu_seqlens": [0, 3], "cu_seqlens_padded": [0, 2]}, "real length 3 > padded length 2"),
        ({"cu_seqlens": [0, 3], "cu_seqlens_padded": [0, 3, 4]}, "entries"),
        ({"cu_seqlens": [0, 3], "total_tokens": 2}, "smaller than cu_seqlens_padded"),
        ({"cu_seqlens": [0, 3], "max_seqlen": 2}, "max_seqlen=2"),
    ],
)
def test_bad_boundaries_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PackedSeqs.from_cu_seqlens(**kwargs)


def test_negative_lengths_raise():
    with pytest.raises(ValueError, match=">= 0"):
        cu_seqlens_from_lengths([2, -1])


lengths_st = st.lists(st.integers(0, 9), min_size=0, max_size=8)


@given(lengths=lengths_st, extra=st.lists(st.integers(0, 3), min_size=8, max_size=8), tail=st.integers(0, 4))
def test_packed_seq_params_round_trip(lengths, extra, tail):
    padded = [n + e for n, e in zip(lengths, extra)]
    ps = PackedSeqs.from_lengths(lengths, padded, total_tokens=sum(padded) + tail)
    params = ps.to_packed_seq_params()
    assert params.qkv_format == "thd"
    assert params.max_seqlen_q == params.max_seqlen_kv == ps.max_seqlen
    assert params.total_tokens == ps.total_tokens
    assert params.pad_between_seqs == (padded != lengths)
    back = PackedSeqs.from_packed_seq_params(params)
    assert back.same_as(ps)


def test_from_packed_seq_params_rejects_other_formats_and_cross_attention():
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="'thd'"):
        PackedSeqs.from_packed_seq_params(PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu))
    other = torch.tensor([0, 3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="differ"):
        PackedSeqs.from_packed_seq_params(
            PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=other)
        )
    # without padded arrays, padded == real
    ps = PackedSeqs.from_packed_seq_params(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, max_seqlen_q=3))
    assert ps.cu_seqlens_padded.tolist() == [0, 2, 5] and ps.max_seqlen == 3 and ps.total_tokens == 5
