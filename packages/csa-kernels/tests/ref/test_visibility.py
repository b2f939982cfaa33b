"""Visibility oracles M1 (compressed entries) and M3 (window), index builders vs brute force, packing."""

import pytest
import torch

from csa_kernels import (
    attention_indices,
    csa_dense_mask,
    indices_to_mask,
    visible_compressed_indices,
    visible_compressed_indices_sbhd,
    window_indices,
    window_indices_sbhd,
)
from dsv4_primitives.varlen import SeqBoundaries, compressed_cu_seqlens, cu_seqlens_from_lengths

LENGTHS = [1, 3, 7, 8, 0, 16, 37, 64, 100]


@pytest.mark.parametrize("ratio", [1, 4, 8, 128])
def test_m1_visible_entries(ratio):
    cu = cu_seqlens_from_lengths(LENGTHS)
    cu_c = compressed_cu_seqlens(cu, ratio)
    idx = visible_compressed_indices(SeqBoundaries.from_tensor(cu), ratio)
    assert idx.dtype == torch.int32 and idx.shape == (sum(LENGTHS), max(n // ratio for n in LENGTHS))
    row = 0
    for d, n in enumerate(LENGTHS):
        for t in range(n):
            vis = [int(cu_c[d]) + w for w in range(n // ratio) if (w + 1) * ratio <= t + 1]
            assert len(vis) == (t + 1) // ratio
            got = idx[row].tolist()
            assert got == vis + [-1] * (idx.shape[1] - len(vis))
            row += 1


@pytest.mark.parametrize("window", [1, 3, 8, 128])
def test_m3_window(window):
    cu = cu_seqlens_from_lengths(LENGTHS)
    idx = window_indices(SeqBoundaries.from_tensor(cu), window)
    assert idx.dtype == torch.int32 and idx.shape == (sum(LENGTHS), window)
    row = 0
    for d, n in enumerate(LENGTHS):
        start = int(cu[d])
        for t in range(n):
            expect = [start + s if s >= 0 else -1 for s in range(t - window + 1, t + 1)]
            assert idx[row].tolist() == expect
            row += 1


def test_dense_mask_equals_index_union():
    ratio, window = 4, 5
    cu = cu_seqlens_from_lengths(LENGTHS)
    cu_c = compressed_cu_seqlens(cu, ratio)
    t, tc = int(cu[-1]), int(cu_c[-1])
    idx = attention_indices(
        window_indices(SeqBoundaries.from_tensor(cu), window),
        visible_compressed_indices(SeqBoundaries.from_tensor(cu), ratio),
        t,
    )
    assert idx.shape == (t, window + max(n // ratio for n in LENGTHS))
    assert torch.equal(
        indices_to_mask(idx, t + tc).bool(), csa_dense_mask(SeqBoundaries.from_tensor(cu), ratio, window)
    )
    assert indices_to_mask(idx, t + tc).max() == 1  # no duplicates in window + visible


def test_sbhd_forms_are_local_and_match_thd():
    s, ratio, window = 37, 4, 6
    cu = cu_seqlens_from_lengths([s, s])
    w_thd = window_indices(SeqBoundaries.from_tensor(cu), window)
    w_sbhd = window_indices_sbhd(s, window)
    assert torch.equal(w_thd[:s], w_sbhd)
    assert torch.equal(w_thd[s:], torch.where(w_sbhd >= 0, w_sbhd + s, -1))
    c_thd = visible_compressed_indices(SeqBoundaries.from_tensor(cu), ratio)
    c_sbhd = visible_compressed_indices_sbhd(s, ratio)
    assert torch.equal(c_thd[:s], c_sbhd)
    assert torch.equal(c_thd[s:], torch.where(c_sbhd >= 0, c_sbhd + s // ratio, -1))
    # SBHD attention indices broadcast the shared window over a batch of compressed selections
    comp = torch.stack([c_sbhd, c_sbhd], 1)  # [S, B, Kc]
    both = attention_indices(w_sbhd[:, None, :], comp, s)
    assert both.shape == (s, 2, window + c_sbhd.shape[1])
    assert torch.equal(both[:, 1, window:], torch.where(c_sbhd >= 0, c_sbhd + s, -1))


def test_attention_indices_keeps_minus_one_and_offsets():
    w = torch.tensor([[-1, 0], [0, 1]], dtype=torch.int32)
    c = torch.tensor([[-1, -1], [0, -1]], dtype=torch.int32)
    assert attention_indices(w, c, 10).tolist() == [[-1, 0, -1, -1], [0, 1, 10, -1]]


def test_indices_to_mask_counts_repeats():
    idx = torch.tensor([[2, 2, -1, 0]], dtype=torch.int32)
    assert indices_to_mask(idx, 3).tolist() == [[1, 0, 2]]


def test_bad_inputs():
    cu = cu_seqlens_from_lengths([8, 4])
    with pytest.raises(ValueError, match="max_entries"):
        visible_compressed_indices(SeqBoundaries.from_tensor(cu), 4, max_entries=1)
    with pytest.raises(ValueError, match="SeqBoundaries"):
        visible_compressed_indices(cu, 4)
    with pytest.raises(ValueError, match="window"):
        window_indices(SeqBoundaries.from_tensor(cu), 0)
    with pytest.raises(ValueError, match="non-decreasing"):
        window_indices(SeqBoundaries.from_tensor(torch.tensor([0, 5, 3], dtype=torch.int32)), 2)
    assert visible_compressed_indices(SeqBoundaries.from_tensor(cu), 4, max_entries=5).shape == (12, 5)
