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

from dsv4_train.config import TrainConfig
from dsv4_train.context_parallel import local_batch, sbhd_as_thd_pack


def test_cp_config_checks():
    assert TrainConfig.from_flat(cp=2, seq_len=64).parallel.cp == 2
    with pytest.raises(ValueError, match=r"--cp-layout 'zigzag' is not supported.*compression groups"):
        TrainConfig.from_flat(cp=2, cp_layout="zigzag")
    with pytest.raises(ValueError, match=r"--seq-len 100 .*multiple of --cp 3.*--seq-len 102"):
        TrainConfig.from_flat(cp=3, seq_len=100, packed=True)
    # under TP x CP the CP rank's rows are cut over TP as well: a multiple of cp alone is not enough
    assert TrainConfig.from_flat(cp=2, tp=2, seq_len=68).data.seq_len == 68
    for packed in (False, True):
        with pytest.raises(
            ValueError, match=r"--seq-len 66 .*multiple of --cp x --tp \(2 x 2 = 4\).*--seq-len 68"
        ):
            TrainConfig.from_flat(cp=2, tp=2, seq_len=66, packed=packed)
    with pytest.raises(ValueError, match="--cuda-graph with --cp 2 is not supported"):
        TrainConfig.from_flat(cp=2, seq_len=64, cuda_graph=True, bf16=True)
    with pytest.raises(ValueError, match="--cp must be >= 1"):
        TrainConfig.from_flat(cp=0)


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


@pytest.fixture(scope="module")
def cp2_world():
    """One 2-rank gloo world: the MTP rolls / router intervals / loss partials and the saved-bytes count."""
    from cp_checks import cp2_worker

    from dsv4_testkit import run_distributed

    return run_distributed(cp2_worker, 2, timeout=900)


@pytest.mark.distributed
def test_cp2_mtp_rolls_router_intervals_and_loss_partials(cp2_world):
    from cp_checks import CU_PADDED, T

    results = cp2_world
    for r in results:
        for key in ("ids", "mask", "dx", "doc_ids"):
            assert torch.equal(r[key], r[f"{key}_ref"]), key
        assert r["num_docs"][0] == r["num_docs"][1]  # every rank keeps every document (empty ones included)
        assert r["count"] == r["count_ref"]
    assert sum(r["partial"] for r in results) == pytest.approx(results[0]["full"], rel=1e-6)  # fp32 sums
    assert int(CU_PADDED[-1]) < T  # the pack has a tail past the last document


@pytest.mark.distributed
def test_cp_memory_formula_against_saved_bytes(cp2_world):
    """``cp_activation_memory`` against the bytes the tiny model saves for backward (distinct storages, parameters
    excluded; fp32, CPU reference path, sparse phase) in one forward of a 512-token document at CP=1 and on each
    rank at CP=2 (rank 1 is the busiest rank: the document enters it from rank 0). ``a`` is calibrated at CP=1
    (as for V4-Flash: a measurement without CP), so the own-rows term is CP=1's bytes / 2; each term is checked.

    Tolerances: ``const`` = the RoPE cos/sin tables sized by the pack's largest position, which every rank keeps
    whole (4 tables x T x rope_dim / 2 x 4 B; the formula omits T-independent-per-rank terms), and ``16 L`` bytes
    for the non-attention part (two ``[1, L]`` int64 id rows of the MTP roll). The formula takes the worst-case
    ``m - 1`` alignment rows per compressor; rank 1's actual alignment (``e0 mod m``) is subtracted exactly."""
    from cp_checks import MEM_T

    from hybrid_model.cp_memory import cp_activation_memory
    from hybrid_model.presets import get_preset

    cfg = get_preset("tiny")
    mem = [r["memory"] for r in cp2_world]
    one = mem[0]["cp1"]
    assert mem[1]["cp1"]["attn"] == one["attn"]  # deterministic (routing noise would show here)
    p = cfg.parsed_pattern
    n_layers = len(p.main) + p.mtp_num_depths * len(p.mtp_pattern)
    a = one["total"] / (MEM_T * n_layers)
    f = cp_activation_memory(cfg, MEM_T, 2, bytes_per_token_layer=a, element_bytes=4, path="reference")
    assert f.gathered == 0 and f.own_rows == pytest.approx(one["total"] / 2)
    local, b = MEM_T // 2, 4
    const = 4 * MEM_T * cfg.qk_rope_head_dim // 2 * b
    # own rows: everything outside the attention halves exactly (MoE, mHC, head) up to the per-rank id rows
    for r in range(2):
        rest = mem[r]["cp"]["total"] - mem[r]["cp"]["attn"]
        assert abs(rest - (one["total"] - one["attn"]) / 2) <= 16 * local, (r, rest)
    # rank 0 (no halo, no clipped document): its attention keeps CP=1's half (the local rows' view of x_ext)
    assert abs(mem[0]["cp"]["attn"] - one["attn"] / 2) <= const, mem[0]
    # rank 1: the halo term, with the formula's worst-case alignment rows replaced by the actual ones (their
    # pooling buffers: CSA 4c + 4c_I, HCA 2c per row)
    c, c_i = cfg.head_dim, cfg.index_head_dim
    slack = 0
    for ratio, pool, layers in ((4, 4 * c + 4 * c_i, 3), (128, 2 * c, 2)):  # tiny: 3 CSA and 2 HCA layers
        h = max(cfg.sliding_window - 1, 2 * ratio - 1 if ratio == 4 else ratio - 1)
        slack += layers * (ratio - 1 - (local - h) % ratio) * pool * b
    overhead = mem[1]["cp"]["attn"] - one["attn"] / 2
    assert abs(overhead - (f.halo - slack)) <= const, (overhead, f.halo, slack)
    assert overhead > 5 * const  # the halo term is what is measured, not the tolerance
    assert abs(mem[1]["cp"]["total"] - f.total) <= slack + const


def test_cp_memory_formula_reproduces_the_readme_table():
    from hybrid_model.cp_memory import cp_activation_memory
    from hybrid_model.presets import get_preset

    cfg = get_preset("v4-flash")
    gib = 2.0**30
    table = {
        (65536, 1): 256.96,
        (65536, 2): 128.54,
        (65536, 4): 64.30,
        (65536, 8): 32.18,
        (131072, 1): 513.92,
        (131072, 2): 257.07,
        (131072, 4): 128.59,
        (131072, 8): 64.35,
    }
    for (t, cp), total in table.items():
        m = cp_activation_memory(cfg, t, cp, pp=8)
        assert round(m.total / gib, 2) == total, (t, cp, m)
        if cp == 1:
            continue
        # only the own rows scale with 1 / CP; the gathered entries are global
        half = cp_activation_memory(cfg, t, 2 * cp, pp=8)
        assert half.own_rows == m.own_rows / 2 and half.gathered == m.gathered
    one = cp_activation_memory(cfg, 65536, 1, pp=8)
    assert one.gathered == one.halo == 0
    with pytest.raises(ValueError, match="multiple of cp"):
        cp_activation_memory(cfg, 100, 3)
    with pytest.raises(ValueError, match="path must be one of"):
        cp_activation_memory(cfg, 64, 2, path="gpu")
