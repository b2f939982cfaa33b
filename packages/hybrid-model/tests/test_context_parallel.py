"""Context parallelism around the model (``dsv4 train --cp``): configuration checks, the per-rank batch slicing
(packed THD and ``[B, S]`` as a THD pack), and over gloo (CP=2 against CP=1 on one pack with a document crossing
the rank boundary, an empty document, per-document padding and a static-shape tail): the MTP rolls (ids, labels,
loss masks; gradients), the routers' per-document intervals and the loss partials."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from hybrid_model.training.config import TrainConfig
from hybrid_model.training.context_parallel import local_batch, sbhd_as_thd_pack


def test_cp_config_checks():
    assert TrainConfig(cp=2, seq_len=64).cp == 2
    with pytest.raises(ValueError, match=r"--cp-layout 'zigzag' is not supported.*compression groups"):
        TrainConfig(cp=2, cp_layout="zigzag")
    with pytest.raises(ValueError, match=r"--seq-len 100 .*multiple of --cp 3.*--seq-len 102"):
        TrainConfig(cp=3, seq_len=100, packed=True)
    with pytest.raises(ValueError, match="--cuda-graph with --cp 2 is not supported"):
        TrainConfig(cp=2, seq_len=64, cuda_graph=True, bf16=True)
    with pytest.raises(ValueError, match="--cp must be >= 1"):
        TrainConfig(cp=0)


def _sbhd_batch(b=2, s=6, cp_size=1):
    from thd_packing import SbhdMicrobatch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (b, s), generator=g)
    pad = torch.zeros(b, s, dtype=torch.bool)
    pad[1, 4:] = True
    return SbhdMicrobatch(
        tokens,
        tokens.roll(-1, 1),
        (~pad).float(),
        torch.arange(s).expand(b, s),
        pad,
        0,
        cp_size,
        (None,) * b,
    )


def test_sbhd_batch_runs_as_a_thd_pack_sliced_per_cp_rank():
    mb = _sbhd_batch()
    fields, pack = sbhd_as_thd_pack(mb)
    assert pack.cu_seqlens.tolist() == pack.cu_seqlens_padded.tolist() == [0, 6, 12]
    assert torch.equal(fields["position_ids"], torch.arange(6).repeat(2))  # document-relative = the row's
    parts = [
        local_batch(mb, packed=False, cp_rank=r, cp_size=3, device=torch.device("cpu")) for r in range(3)
    ]
    for name in ("tokens", "labels", "loss_mask", "position_ids", "padding_mask"):
        got = torch.cat([getattr(p, name) for p in parts], dim=1)  # [1, B*S]
        assert got.shape == (1, 12)
        assert torch.equal(got[0], getattr(mb, name).reshape(-1)), name
    for p in parts:  # every CP rank gets the global pack
        assert p.packed_seq_params.cu_seqlens_q_padded.tolist() == [0, 6, 12]
        assert (
            p.packed_seq_params.cp_group is None
        )  # static CP: the group comes from the model's pg_collection
    same = local_batch(mb, packed=False, cp_rank=0, cp_size=1, device=torch.device("cpu"))
    assert same.packed_seq_params is None and torch.equal(same.tokens, mb.tokens)  # CP=1: [B, S] unchanged
    with pytest.raises(ValueError, match="whole \\[B, S\\] rows"):
        sbhd_as_thd_pack(_sbhd_batch(cp_size=2))


def test_packed_batch_slices_and_global_params():
    from thd_packing import BatchConfig, PackedBatchIterator, default_corpus_dataset

    ds = default_corpus_dataset(64)
    batches = {}
    for cp_rank in (0, 1):
        cfg = BatchConfig(
            global_batch_size=3, max_seqlen_per_dp_cp_rank=32, cp_size=2, cp_rank=cp_rank, seed=1
        )
        batches[cp_rank] = next(PackedBatchIterator(ds, cfg))
    whole = next(
        PackedBatchIterator(ds, BatchConfig(global_batch_size=3, max_seqlen_per_dp_cp_rank=64, seed=1))
    )
    assert batches[0].num_microbatches == batches[1].num_microbatches == whole.num_microbatches
    cpu = torch.device("cpu")
    for i, ref in enumerate(whole.microbatches):
        parts = [
            local_batch(batches[r].microbatches[i], packed=True, cp_rank=r, cp_size=2, device=cpu)
            for r in (0, 1)
        ]
        assert torch.equal(torch.cat([p.tokens for p in parts], dim=1)[0], ref.tokens)
        assert torch.equal(torch.cat([p.loss_mask for p in parts], dim=1)[0], ref.loss_mask)
        for p in parts:
            assert torch.equal(p.packed_seq_params.cu_seqlens_q_padded, ref.packed_seqs.cu_seqlens_padded)
    with pytest.raises(ValueError, match="build the batch iterator with this rank's cp_rank"):
        local_batch(batches[1].microbatches[0], packed=True, cp_rank=0, cp_size=2, device=cpu)


@pytest.mark.distributed
def test_cp2_mtp_rolls_router_intervals_and_loss_partials():
    from cp_checks import CU_PADDED, T, mtp_and_loss_worker

    from dsv4_testkit import run_distributed

    results = run_distributed(mtp_and_loss_worker, 2, timeout=300)
    for r in results:
        for key in ("ids", "mask", "dx", "doc_ids"):
            assert torch.equal(r[key], r[f"{key}_ref"]), key
        assert r["num_docs"][0] == r["num_docs"][1]  # every rank keeps every document (empty ones included)
        assert r["count"] == r["count_ref"]
    assert sum(r["partial"] for r in results) == pytest.approx(results[0]["full"], rel=1e-6)  # fp32 sums
    assert int(CU_PADDED[-1]) < T  # the pack has a tail past the last document


def test_cp_memory_formula_reproduces_the_readme_table():
    from hybrid_model.cp_memory import cp_activation_memory
    from hybrid_model.presets import get_preset

    cfg = get_preset("v4-flash")
    gib = 2.0**30
    table = {(65536, 8): 32.18, (65536, 16): 16.12, (131072, 8): 64.35, (131072, 16): 32.23}
    for (t, cp), total in table.items():
        m = cp_activation_memory(cfg, t, cp, pp=8)
        assert round(m.total / gib, 2) == total, (t, cp, m)
        # only the own rows scale with 1 / CP; the gathered entries are global
        half = cp_activation_memory(cfg, t, 2 * cp, pp=8)
        assert half.own_rows == m.own_rows / 2 and half.gathered == m.gathered
    one = cp_activation_memory(cfg, 65536, 1, pp=8)
    assert one.gathered == one.halo == 0
    with pytest.raises(ValueError, match="multiple of cp"):
        cp_activation_memory(cfg, 100, 3)
