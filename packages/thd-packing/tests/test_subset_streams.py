"""``VarlenSubset`` views, ``RawTextDataset.sample_documents`` and independent mock streams."""

import numpy as np
import pytest

from thd_packing import (
    MockVarlenConfig,
    MockVarlenDataset,
    RawTextDataset,
    TextDatasetConfig,
    VarlenDataset,
    VarlenSubset,
)


def test_subset_is_a_view_of_the_chosen_samples():
    ds = MockVarlenDataset(MockVarlenConfig(seq_length=32, num_samples=20))
    sub = VarlenSubset(ds, np.array([7, 2, 19]))
    assert isinstance(sub, VarlenDataset) and len(sub) == 3
    assert np.array_equal(sub.lengths, ds.lengths[[7, 2, 19]])
    assert (sub.eod, sub.pad_id, sub.vocab_size) == (ds.eod, ds.pad_id, ds.vocab_size)
    assert sub[1].tokens.equal(ds[2].tokens) and sub[-1].labels.equal(ds[19].labels)
    with pytest.raises(IndexError):
        sub[3]
    with pytest.raises(ValueError, match=r"must lie in \[0, 20\)"):
        VarlenSubset(ds, np.array([20]))


def test_sample_documents_keep_split_pieces_together():
    ds = RawTextDataset.from_texts(["a" * 10, "b" * 25, "", "c" * 3], TextDatasetConfig(8))
    # 10 + EOD -> 2 pieces, 25 + EOD -> 4 pieces, empty -> 1, 3 + EOD -> 1
    assert ds.sample_documents.tolist() == [0, 0, 1, 1, 1, 1, 2, 3]


def test_mock_streams_are_independent_and_stream_0_is_unchanged():
    base = dict(seq_length=64, num_samples=50, seed=3)
    s0 = MockVarlenDataset(MockVarlenConfig(**base))
    s1 = MockVarlenDataset(MockVarlenConfig(**base, stream=1))
    # stream 0 is the original data: lengths from default_rng(seed), ids from default_rng([seed, i])
    rng = np.random.default_rng(3)
    mu = np.log(48) - 1.1**2 / 2
    assert np.array_equal(
        s0.lengths, np.clip(np.rint(rng.lognormal(mu, 1.1, size=50)), 32, 64).astype(np.int64)
    )
    ids = np.random.default_rng([3, 4]).integers(0, s0.eod, size=int(s0.lengths[4]))
    assert np.array_equal(s0[4].tokens.numpy(), ids)
    assert not np.array_equal(s0.lengths, s1.lengths)
    assert all(not s0[i].tokens[:16].equal(s1[i].tokens[:16]) for i in range(10))
    assert MockVarlenDataset(MockVarlenConfig(**base, stream=1))[5].tokens.equal(
        s1[5].tokens
    )  # deterministic
    with pytest.raises(ValueError, match="stream must be >= 0"):
        MockVarlenConfig(**base, stream=-1)
