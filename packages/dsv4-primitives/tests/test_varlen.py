"""dsv4_primitives.varlen: lengths <-> cu_seqlens <-> document ids / positions, compressed boundaries, SeqBoundaries,
and the cached host-int upload."""

import pytest
import torch

from dsv4_primitives.varlen import (
    SeqBoundaries,
    check_cu_seqlens,
    compressed_cu_seqlens,
    compressed_cu_seqlens_host,
    cu_seqlens_from_lengths,
    document_ids,
    document_positions,
    lengths_from_cu_seqlens,
    sbhd_cu_seqlens,
    sbhd_cu_seqlens_host,
    sbhd_to_thd,
    thd_to_sbhd,
    upload_host_ints,
)


def _loop_ids_positions(lengths, tail=0):
    """Python oracle: per-row document index and document-relative position (tail rows continue the last doc)."""
    ids, pos = [], []
    for d, n in enumerate(lengths):
        ids += [d] * n
        pos += list(range(n))
    last_start = sum(lengths[:-1]) if lengths else 0
    end = sum(lengths)
    ids += [len(lengths)] * tail
    pos += [end + i - last_start for i in range(tail)]
    return ids, pos


@pytest.mark.parametrize("lengths", [[], [0], [5], [3, 0, 4], [0, 0, 2, 1, 0], [1] * 7])
@pytest.mark.parametrize("tail", [0, 3])
def test_ids_and_positions_match_the_loop_oracle(lengths, tail):
    cu = cu_seqlens_from_lengths(lengths)
    assert cu.dtype == torch.int32 and cu.tolist() == [
        0,
        *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist(),
    ]
    assert lengths_from_cu_seqlens(cu).tolist() == lengths
    ids, pos = _loop_ids_positions(lengths, tail)
    total = sum(lengths) + tail
    assert document_ids(cu, total).tolist() == ids
    assert document_positions(cu, total).tolist() == pos
    assert document_ids(cu, total, tail=-1).tolist() == ids[: sum(lengths)] + [-1] * tail
    if not tail:  # total read back from the device
        assert document_ids(cu).tolist() == ids and document_positions(cu).tolist() == pos


def test_positions_equal_rope_positions_from_cu_seqlens():
    from dsv4_primitives import positions_from_cu_seqlens

    cu = cu_seqlens_from_lengths([4, 0, 3, 1])
    for total in (8, 11):
        assert torch.equal(document_positions(cu, total), positions_from_cu_seqlens(cu, total))


def test_cu_seqlens_from_lengths_inputs():
    assert cu_seqlens_from_lengths(torch.tensor([2, 3])).tolist() == [0, 2, 5]
    import numpy as np

    assert cu_seqlens_from_lengths(np.array([1, 2])).tolist() == [0, 1, 3]
    for bad in ([1, -1], [1.5], [True], torch.tensor([1.0]), torch.tensor([-2])):
        with pytest.raises(ValueError, match="lengths"):
            cu_seqlens_from_lengths(bad)


@pytest.mark.parametrize("ratio", [1, 2, 4, 128])
def test_compressed_cu_seqlens_device_and_host_agree(ratio):
    lengths = [0, 7, 8, 129, 3, 256]
    cu = cu_seqlens_from_lengths(lengths)
    want = [0, *torch.tensor([n // ratio for n in lengths]).cumsum(0).tolist()]
    assert compressed_cu_seqlens(cu, ratio).tolist() == want
    assert compressed_cu_seqlens(cu, ratio, cu_seqlens_host=cu.tolist()).tolist() == want
    assert compressed_cu_seqlens_host(cu.tolist(), ratio) == want
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="ratio"):
            compressed_cu_seqlens_host(cu.tolist(), bad)


def test_check_cu_seqlens_messages():
    assert check_cu_seqlens(torch.tensor([0, 2, 2, 5], dtype=torch.int32)) == [0, 2, 2, 5]
    cases = [
        (torch.tensor([1, 2]), {}, r"cu_seqlens\[0\] must be 0"),
        (torch.tensor([0, 3, 2]), {}, "non-decreasing"),
        (torch.tensor([0.0, 1.0]), {}, "int32"),
        (torch.tensor([[0, 1]]), {}, "1-D"),
        (torch.tensor([0, 3]), {"total": 4}, "number of packed rows"),
        (torch.tensor([0, 3]), {"host": [0, 3, 4]}, "host copy"),
        (torch.tensor([0, 3]), {"host": [0, 3.0]}, "Python ints"),
    ]
    for cu, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            check_cu_seqlens(cu, **kw)


def test_sbhd_views_round_trip():
    x = torch.randn(5, 3, 2)  # [S, B, D]
    t = sbhd_to_thd(x)  # [B*S, D]
    assert torch.equal(t[5:10], x[:, 1]) and torch.equal(thd_to_sbhd(t, 3), x)
    assert sbhd_cu_seqlens(3, 5).tolist() == sbhd_cu_seqlens_host(3, 5) == [0, 5, 10, 15]
    with pytest.raises(ValueError, match=">= 0"):
        sbhd_cu_seqlens_host(-1, 2)


def test_seq_boundaries_carry_host_copy_and_compress_without_reading_back():
    b = SeqBoundaries.from_lengths([5, 0, 9])
    assert b.cu_seqlens.tolist() == list(b.cu_seqlens_host) == [0, 5, 5, 14]
    assert (b.num_docs, b.total, b.max_seqlen, b.lengths_host) == (3, 14, 9, (5, 0, 9))
    c = b.compressed(4)
    assert c.cu_seqlens_host == (0, 1, 1, 3) and c.cu_seqlens.tolist() == [0, 1, 1, 3]
    assert c.cu_seqlens.device == b.device
    assert b.compressed(4) is c and not c.is_static and b.max_entries(4) == 2
    t = SeqBoundaries.from_tensor(torch.tensor([0, 2, 6], dtype=torch.int32))
    assert t.cu_seqlens_host == (0, 2, 6) and t.to("cpu").cu_seqlens.tolist() == [0, 2, 6]
    with pytest.raises(AttributeError):
        b.cu_seqlens_host = (0,)  # frozen


def test_seq_boundaries_static_mode_derives_on_the_device():
    # a static pack: 2 documents (+ one unused slot) padded to a capacity of 16 rows; nothing is read back
    cu = torch.tensor([0, 5, 14, 16, 16], dtype=torch.int32)
    s = SeqBoundaries.static(cu, 16)
    h = SeqBoundaries.from_tensor(cu)
    assert s.is_static and s.cu_seqlens is cu and (s.total, s.num_docs, s.max_seqlen) == (16, 4, 16)
    assert s.max_entries(4) == 4 and h.max_entries(4) == 2
    c = s.compressed(4)
    assert c.is_static and c.total == 4 and c.cu_seqlens.tolist() == list(h.compressed(4).cu_seqlens_host)
    assert torch.equal(s.document_ids(), h.document_ids()) and torch.equal(s.positions(), h.positions())
    assert s.exact().cu_seqlens_host == h.cu_seqlens_host and s.to("cpu").is_static
    with pytest.raises(ValueError, match="device only"):
        _ = s.host
    with pytest.raises(ValueError, match="exactly one of"):
        SeqBoundaries(cu)
    with pytest.raises(ValueError, match="capacity must be an int"):
        SeqBoundaries.static(cu, -1)
    with pytest.raises(ValueError, match="at least one document slot"):
        SeqBoundaries.static(torch.zeros(1, dtype=torch.int32), 0)


def test_seq_boundaries_validate():
    with pytest.raises(ValueError, match="non-decreasing"):
        SeqBoundaries.from_host([0, 4, 2])
    with pytest.raises(ValueError, match="3 values but cu_seqlens has 2"):
        SeqBoundaries(torch.tensor([0, 4], dtype=torch.int32), (0, 4, 6))
    with pytest.raises(ValueError, match="1-D int32"):
        SeqBoundaries(torch.tensor([0.0, 4.0]), (0, 4))
    with pytest.raises(ValueError, match="lengths"):
        SeqBoundaries.from_lengths([3, -1])


def test_upload_host_ints_cpu_makes_a_fresh_tensor():
    a = upload_host_ints([[1, 2], [3, 4]], "cpu")
    assert a.dtype == torch.int32 and a.tolist() == [[1, 2], [3, 4]]
    assert upload_host_ints([[1, 2], [3, 4]], None, torch.int64) is not a


@pytest.mark.gpu
def test_upload_host_ints_is_a_cached_constant_and_graph_capturable():
    """CUDA: equal host lists give the same device tensor (no second copy); inside a CUDA-graph capture a new list
    is copied from a kept pinned buffer, so every replay sees its values, and the entry is never evicted."""
    from dsv4_primitives.varlen.upload import _DEVICE_INTS, upload_host_ints

    a = upload_host_ints([0, 5, 9], "cuda")
    assert upload_host_ints([0, 5, 9], "cuda") is a and a.tolist() == [0, 5, 9]
    assert upload_host_ints([[1, 2], [3, 4]], "cuda").tolist() == [[1, 2], [3, 4]]
    assert upload_host_ints([0, 5, 9], "cuda", torch.int64) is not a
    with torch.inference_mode():
        inf = upload_host_ints([5, 6, 7, 8], "cuda")
    assert not inf.is_inference()  # reused later by training steps that save it for backward
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = upload_host_ints([7, 11, 2026], "cuda") * 2 + upload_host_ints([0, 5, 9], "cuda")
    for _ in range(2):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert out.tolist() == [14, 27, 4061]
    for i in range(_DEVICE_INTS.capacity + 1):  # churn the LRU: captured entries survive
        upload_host_ints([i, 123456], "cuda")
    g.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [14, 27, 4061]
    assert upload_host_ints([7, 11, 2026], "cuda").tolist() == [7, 11, 2026]


def test_device_int_cache_logic_on_cpu_tensors():
    """The cache of ``upload_host_ints`` (driven with CPU tensors here): equal values give the same tensor, no
    inference tensors are cached, the LRU is bounded, and an entry whose copy exists only in an aborted capture is
    filled at its next use outside a capture."""
    from dsv4_primitives.varlen.upload import _DeviceIntCache

    cache = _DeviceIntCache(capacity=2)
    cpu = torch.device("cpu")
    a = cache.get([0, 5, 9], torch.int32, cpu)
    assert cache.get([0, 5, 9], torch.int32, cpu) is a
    with torch.inference_mode():
        b = cache.get([1, 2], torch.int32, cpu)
    assert not b.is_inference()
    cache.get([3], torch.int32, cpu)
    assert len(cache.entries) == 2 and cache.get([0, 5, 9], torch.int32, cpu) is not a
    key = (cpu, torch.int32, (7, 8))
    cache.kept[key] = [torch.zeros(2, dtype=torch.int32), torch.tensor([7, 8], dtype=torch.int32), False]
    assert cache.get([7, 8], torch.int32, cpu).tolist() == [7, 8]
