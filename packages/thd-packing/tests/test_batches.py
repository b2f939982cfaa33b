import json

import pytest
import torch

from thd_packing import (
    BatchConfig,
    MockVarlenConfig,
    MockVarlenDataset,
    PackedBatchIterator,
    PackedSeqs,
    default_corpus_dataset,
)


@pytest.fixture(scope="module")
def mock():
    # lengths 1..40 around 20; capacity 32 per pack (16 rows x CP 2) forces splits of the longest documents
    return MockVarlenDataset(
        MockVarlenConfig(seq_length=40, min_len=1, max_len=40, mean_len=12, num_samples=50, seed=1)
    )


def _global_packs(dataset, cfg_kwargs, iteration=0):
    """{dp_rank: [(global PackedSeqs, {name: global tensor}, pieces, microbatch of cp rank 0)]} re-assembled
    from every CP rank's slices."""
    base = BatchConfig(**cfg_kwargs)
    out = {}
    for d in range(base.dp_size):
        per_cp = []
        for c in range(base.cp_size):
            it = PackedBatchIterator(dataset, BatchConfig(**{**cfg_kwargs, "dp_rank": d, "cp_rank": c}))
            it.load_state_dict({"iteration": iteration})
            per_cp.append(next(it))
        packs = []
        for m in range(per_cp[0].num_microbatches):
            mbs = [b.microbatches[m] for b in per_cp]
            assert all(mb.packed_seqs.same_as(mbs[0].packed_seqs) for mb in mbs)
            tensors = {
                k: torch.cat([getattr(mb, k) for mb in mbs])
                for k in ("tokens", "labels", "loss_mask", "position_ids", "padding_mask")
            }
            packs.append((mbs[0].packed_seqs, tensors, mbs[0].pieces, per_cp[0]))
        out[d] = packs
    return out


def _check_pack_contents(dataset, packed: PackedSeqs, tensors, pieces, pad_id):
    cu_pad = packed.cu_seqlens_padded.tolist()
    real = torch.zeros(packed.total_tokens, dtype=torch.bool)
    for i, piece in enumerate(pieces):
        sample = dataset[piece.doc]
        sl = slice(piece.start, piece.start + piece.length)
        rows = slice(cu_pad[i], cu_pad[i] + piece.length)
        assert torch.equal(tensors["tokens"][rows], sample.tokens[sl])
        assert torch.equal(tensors["labels"][rows], sample.labels[sl])
        assert torch.equal(tensors["loss_mask"][rows], sample.loss_mask[sl])
        assert tensors["position_ids"][rows].tolist() == list(range(piece.length))
        real[rows] = True
    assert torch.equal(tensors["padding_mask"], ~real)
    assert (tensors["loss_mask"][~real] == 0).all() and (tensors["tokens"][~real] == pad_id).all()
    assert torch.equal(tensors["position_ids"], packed.position_ids)


@pytest.mark.parametrize("static", [True, False])
def test_thd_iteration_covers_every_document_once(mock, static):
    kw = dict(
        global_batch_size=12,
        max_seqlen_per_dp_cp_rank=16,
        dp_size=2,
        cp_size=2,
        static_shape=static,
        max_num_seqs=6,
        seed=5,
    )
    packs = _global_packs(mock, kw)
    docs = PackedBatchIterator(mock, BatchConfig(**kw)).documents_of(0)
    seen: dict[int, int] = {}
    counts = set()
    for dp_packs in packs.values():
        counts.add(len(dp_packs))
        for packed, tensors, pieces, batch in dp_packs:
            assert batch.num_microbatches == len(dp_packs)
            if static:
                assert (
                    packed.total_tokens == 32 and packed.cu_seqlens.numel() == 7 and packed.max_seqlen == 32
                )
            else:
                assert packed.total_tokens % 2 == 0
            assert len(pieces) <= 5 if static else True
            _check_pack_contents(mock, packed, tensors, pieces, mock.pad_id)
            for p in pieces:
                seen[p.doc] = seen.get(p.doc, 0) + p.length
    assert len(counts) == 1
    assert sorted(seen) == sorted(set(docs.tolist()))
    assert all(seen[doc] == mock.lengths[doc] for doc in seen)
    first = packs[0][0][3]
    assert first.seqlen_sum == int(mock.lengths[docs].sum())
    assert first.seqlen_squared_sum >= first.seqlen_sum
    assert sum(packs[d][0][3].num_real_tokens for d in packs) == first.seqlen_sum


def test_thd_microbatch_api(mock):
    it = PackedBatchIterator(
        mock, BatchConfig(global_batch_size=4, max_seqlen_per_dp_cp_rank=64, cp_size=2, cp_rank=1)
    )
    mb = next(it).microbatches[0]
    assert mb.tokens.shape == (64,) and mb.tokens.dtype == torch.int64 and mb.loss_mask.dtype == torch.float32
    assert mb.padding_mask.dtype == torch.bool and mb.cp_rank == 1 and mb.cp_size == 2
    params = mb.packed_seq_params()
    assert params.qkv_format == "thd" and params.max_seqlen_q == 128
    assert mb.to("cpu").packed_seqs.same_as(mb.packed_seqs)


def test_sbhd_batches(mock):
    kw = dict(
        global_batch_size=10,
        max_seqlen_per_dp_cp_rank=24,
        layout="sbhd",
        micro_batch_size=2,
        dp_size=2,
        cp_size=2,
        seed=2,
    )
    docs = PackedBatchIterator(mock, BatchConfig(**kw)).documents_of(0)
    covered: dict[int, int] = {}
    nums = set()
    for d in range(2):
        cp_batches = []
        for c in range(2):
            it = PackedBatchIterator(mock, BatchConfig(**{**kw, "dp_rank": d, "cp_rank": c}))
            cp_batches.append(next(it))
        nums.add(cp_batches[0].num_microbatches)
        for m in range(cp_batches[0].num_microbatches):
            halves = [b.microbatches[m] for b in cp_batches]
            assert halves[0].tokens.shape == (2, 12)
            tokens = torch.cat([h.tokens for h in halves], dim=1)
            labels = torch.cat([h.labels for h in halves], dim=1)
            loss = torch.cat([h.loss_mask for h in halves], dim=1)
            pos = torch.cat([h.position_ids for h in halves], dim=1)
            assert pos[0].tolist() == list(range(24))
            for r, piece in enumerate(halves[0].pieces):
                if piece is None:
                    assert (loss[r] == 0).all()
                    continue
                sample = mock[piece.doc]
                sl = slice(piece.start, piece.start + piece.length)
                assert torch.equal(tokens[r, : piece.length], sample.tokens[sl])
                assert torch.equal(labels[r, : piece.length], sample.labels[sl])
                assert (loss[r, piece.length :] == 0).all() and (
                    tokens[r, piece.length :] == mock.pad_id
                ).all()
                covered[piece.doc] = covered.get(piece.doc, 0) + piece.length
    assert len(nums) == 1
    assert sorted(covered) == sorted(set(docs.tolist()))
    assert all(covered[doc] == mock.lengths[doc] for doc in covered)


def test_resume_epochs_and_order(mock):
    cfg = BatchConfig(global_batch_size=20, max_seqlen_per_dp_cp_rank=48, num_epochs=2, seed=9)
    it = PackedBatchIterator(mock, cfg)
    batches = list(it)
    assert len(batches) == 5  # 2 epochs x 50 documents / 20 per iteration, last partial batch unused
    resumed = PackedBatchIterator(mock, cfg)
    resumed.load_state_dict({"iteration": 3})
    again = next(resumed)
    assert [mb.pieces for mb in again.microbatches] == [mb.pieces for mb in batches[3].microbatches]
    # each epoch is a permutation of the dataset; iteration 2 spans the epoch boundary
    stream = torch.cat([torch.from_numpy(it.documents_of(i)) for i in range(5)])
    assert sorted(stream[:50].tolist()) == list(range(50)) and sorted(stream[50:].tolist())[:50] == list(
        range(50)
    )
    ordered = PackedBatchIterator(
        mock, BatchConfig(global_batch_size=7, max_seqlen_per_dp_cp_rank=48, shuffle=False)
    )
    assert ordered.documents_of(1).tolist() == list(range(7, 14))


def test_reject_policy_and_config_errors(mock):
    cfg = BatchConfig(global_batch_size=50, max_seqlen_per_dp_cp_rank=8, too_long="reject")
    with pytest.raises(ValueError, match="tokens"):
        next(PackedBatchIterator(mock, cfg))
    with pytest.raises(ValueError, match="tokens but the SBHD sequence length"):
        next(PackedBatchIterator(mock, BatchConfig(**{**cfg.__dict__, "layout": "sbhd"})))
    for kwargs, match in [
        (dict(layout="bshd"), "layout"),
        (dict(dp_rank=2, dp_size=2), "dp_rank"),
        (dict(cp_rank=1), "cp_rank"),
        (dict(max_num_seqs=1), "max_num_seqs"),
        (dict(layout="sbhd", cp_size=3), "multiple of cp_size"),
        (dict(num_epochs=0), "num_epochs"),
    ]:
        with pytest.raises(ValueError, match=match):
            BatchConfig(global_batch_size=4, max_seqlen_per_dp_cp_rank=8, **kwargs)


@pytest.mark.parametrize("layout", ["thd", "sbhd"])
def test_long_text_documents_are_split_never_dropped(tmp_path, layout):
    """A text far longer than both the dataset's seq_capacity and the pack capacity reaches the model whole: the
    dataset splits it into samples, THD packing / SBHD rows split those into pieces, every token trained once."""
    from thd_packing import RawTextDataset, TextDatasetConfig

    long = "".join(chr(ord("a") + i % 26) for i in range(1000))
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"text": long}) + "\n" + json.dumps({"text": "short"}) + "\n"
    )
    ds = RawTextDataset.from_paths(tmp_path / "a.jsonl", TextDatasetConfig(seq_capacity=300))
    cfg = BatchConfig(
        global_batch_size=len(ds), max_seqlen_per_dp_cp_rank=64, layout=layout, shuffle=False, max_num_seqs=4
    )
    batch = next(PackedBatchIterator(ds, cfg))
    got: dict[int, list[tuple[int, list[int], list[int]]]] = {}
    for mb in batch.microbatches:
        for b, piece in enumerate(mb.pieces):
            if piece is None:  # an SBHD filler row
                continue
            if layout == "thd":
                row0 = int(mb.packed_seqs.cu_seqlens_padded[b])
                t, lab = mb.tokens[row0 : row0 + piece.length], mb.labels[row0 : row0 + piece.length]
            else:
                t, lab = mb.tokens[b, : piece.length], mb.labels[b, : piece.length]
            got.setdefault(piece.doc, []).append((piece.start, t.tolist(), lab.tolist()))
    tokens = [t for doc in sorted(got) for _, ts, _ in sorted(got[doc]) for t in ts]
    labels = [x for doc in sorted(got) for _, _, ls in sorted(got[doc]) for x in ls]
    ids = list(long.encode()) + [ds.eod] + list(b"short") + [ds.eod]
    assert tokens == [t for i, t in enumerate(ids[:-1]) if i != len(long)]  # no EOD row between documents
    assert labels == [t for i, t in enumerate(ids[1:]) if i != len(long)]
    assert batch.seqlen_sum == len(long) + len("short")


def test_default_corpus_feeds_the_iterator():
    ds = default_corpus_dataset(seq_capacity=256, max_bytes=150_000)
    it = PackedBatchIterator(ds, BatchConfig(global_batch_size=4, max_seqlen_per_dp_cp_rank=128, cp_size=2))
    batch = next(it)
    assert batch.num_microbatches >= 2 and batch.seqlen_sum == int(ds.lengths[it.documents_of(0)].sum())
    mb = batch.microbatches[0]
    assert mb.tokens.shape == (128,) and int(mb.tokens.max()) < ds.vocab_size


def test_build_dataset_entry_point(tmp_path):
    from thd_packing import RawTextDataset, build_dataset

    default = build_dataset(seq_capacity=64, default_corpus_max_bytes=50_000)
    assert isinstance(default, RawTextDataset) and default.lengths.max() <= 64
    mock = build_dataset("mock", seq_capacity=32)
    assert isinstance(mock, MockVarlenDataset) and mock.lengths.max() <= 32
    (tmp_path / "a.jsonl").write_text('{"text": "abc"}\n')
    files = build_dataset([tmp_path / "a.jsonl"], seq_capacity=8, eod_mask_loss=True)
    assert files[0].loss_mask.tolist() == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="exceeds seq_capacity"):
        build_dataset("mock", seq_capacity=8, mock=MockVarlenConfig(seq_length=16))
    with pytest.raises(ValueError, match="only applies"):
        build_dataset(tmp_path / "a.jsonl", seq_capacity=8, mock=MockVarlenConfig(seq_length=8))


@pytest.mark.gpu
def test_batches_and_roll_move_to_cuda(mock):
    from thd_packing import roll_left

    mb = next(
        PackedBatchIterator(mock, BatchConfig(global_batch_size=4, max_seqlen_per_dp_cp_rank=64))
    ).microbatches[0]
    cuda = mb.to("cuda")
    assert cuda.tokens.is_cuda and cuda.packed_seqs.cu_seqlens.is_cuda
    rolled = roll_left(cuda.labels, cuda.packed_seqs, fill_value=0)
    assert torch.equal(rolled.cpu(), roll_left(mb.labels, mb.packed_seqs, fill_value=0))
