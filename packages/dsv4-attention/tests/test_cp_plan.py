"""Single-process tests of the CP index maps (D7): every rank's view simulated from the global layout.

For random packs (empty documents, padding, static tail) and CP sizes 2..5: the window rows, the visible compressed
ids, the entry ownership (a partition of CP=1's ids, each owned by the rank holding its last token, within the
static capacity) and the logical id -> gathered row map; and the owned entries computed by each simulated rank from
its extended rows alone equal CP=1's compressor output rows exactly (the zero-row realignment of clipped groups).
"""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch
from _cp_cases import pack_layout

from dsv4_attention import Compressor, CompressorConfig, LayerKind, rope_config_for_kind
from dsv4_attention._kernels import visible_compressed_indices, window_indices
from dsv4_attention.cp import ContextParallelLayout, halo_rows, owned_before
from dsv4_attention.cp.compressed import owned_entries


def _random_pack(rng: random.Random, p: int, scale: int):
    lengths = [rng.choice([0, 1, 3, rng.randrange(1, 3 * scale)]) for _ in range(rng.randrange(1, 6))]
    padded = [n + rng.choice([0, 0, 1, 5]) for n in lengths]
    used = sum(padded)
    big_l = -(-max(used, 1) // p) + rng.choice([0, 2])
    return pack_layout(lengths, padded, big_l * p)


CASES = [
    (ratio, overlap, scale) for ratio, overlap, scale in ((0, False, 20), (4, True, 20), (128, False, 300))
]


@pytest.mark.parametrize("ratio,overlap,scale", CASES)
def test_plan_maps_match_cp1(ratio, overlap, scale):
    rng = random.Random(ratio)
    window = 8
    for _ in range(12):
        p = rng.randrange(2, 6)
        glob = _random_pack(rng, p, scale)
        win_ref = window_indices(glob.cu_seqlens, window)  # [T, W] global rows
        if ratio:
            vis_ref = visible_compressed_indices(
                glob.cu_seqlens, _cu_c(glob, ratio), ratio, glob.max_compressed_entries(ratio)
            )
        owners, slots = [], []
        for r in range(p):
            cpl = ContextParallelLayout(glob, None, r, p)
            plan = cpl.plan(window, ratio, overlap)
            ls, le, e0 = cpl.local_start, cpl.local_stop, cpl.local_start - plan.halo
            assert plan.halo_request == halo_rows(window, ratio, overlap)
            assert plan.halo == min(plan.halo_request, ls)
            got = torch.where(plan.window >= 0, plan.window + e0, -1)
            torch.testing.assert_close(got, win_ref[ls:le], rtol=0, atol=0)
            torch.testing.assert_close(plan.ext_positions, glob.positions[e0:le], rtol=0, atol=0)
            if not ratio:
                continue
            torch.testing.assert_close(plan.visible, vis_ref[ls:le], rtol=0, atol=0)
            n_own = plan.owned_rows.numel()
            assert n_own <= plan.capacity == cpl.num_local_tokens // ratio + 1
            g0 = owned_before(list(glob.bounds_host), ratio, ls)
            owners += [r] * n_own
            slots += list(range(g0, g0 + n_own))
        if ratio:
            tc = glob.compressed_bounds_host(ratio)[-1]
            assert slots == list(range(tc))  # the owned ranges partition CP=1's ids in order
            gather = ContextParallelLayout(glob, None, 0, p).plan(window, ratio, overlap).gather_rows
            cap = glob.num_tokens // p // ratio + 1
            assert (gather // cap).tolist() == owners
            # every owner holds the entry's last token
            last = _entry_last_rows(glob, ratio)
            assert (last // (glob.num_tokens // p)).tolist() == owners


def _cu_c(glob, ratio):
    return torch.tensor(glob.compressed_bounds_host(ratio), dtype=torch.int32)


def _entry_last_rows(glob, ratio):
    out = []
    bounds = list(glob.bounds_host)
    for s, e in itertools.pairwise(bounds):
        out += [s + (w + 1) * ratio - 1 for w in range((e - s) // ratio)]
    return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize("kind", [LayerKind.CSA, LayerKind.HCA])
def test_owned_entries_equal_cp1_compressor(kind):
    """Each simulated rank pools its owned entries from its extended rows only: CP=1's rows, bit for bit."""
    torch.manual_seed(0)
    d, c = 16, 8
    comp = Compressor(CompressorConfig(kind, d, c), rope_config_for_kind(kind, 4))
    with torch.no_grad():
        comp.ape.normal_()
    ratio = kind.compress_ratio
    packs = (
        [([13, 0, 3, 20, 9], [13, 0, 5, 22, 9], 52)]
        if ratio == 4
        else [([300, 3, 0, 60], [300, 3, 0, 64], 384), ([129, 250], None, 380)]
    )
    for lengths, padded, total in packs:
        glob = pack_layout(lengths, padded, total)
        x = torch.randn(total, d)
        ref, _ = comp(x, glob.cu_seqlens, backend="reference", max_position=glob.max_rope_position)
        for p in (2, 4):
            parts = []
            for r in range(p):
                cpl = ContextParallelLayout(glob, None, r, p)
                plan = cpl.plan(8, ratio, kind.overlap)
                x_ext = x[cpl.local_start - plan.halo : cpl.local_stop]
                own = owned_entries(comp, x_ext, plan, glob.max_rope_position, "reference")
                parts.append(own)
            gathered = torch.cat(parts)[plan.gather_rows]
            torch.testing.assert_close(gathered, ref, rtol=0, atol=0)


def test_cp_refusals():
    from dsv4_attention.cp import packed_context_parallel_layout

    glob = pack_layout([10, 3], None, 14)
    with pytest.raises(ValueError, match="not a multiple of the context-parallel size 4"):
        ContextParallelLayout(glob, None, 0, 4)
    with pytest.raises(ValueError, match="SBHD"):  # CP needs the global THD pack, never [s, b, h]
        packed_context_parallel_layout(torch.zeros(4, 2, 8), None, object())
    with pytest.raises(ValueError, match=r"\[L, 1, h\]"):
        psp = SimpleNamespace(qkv_format="thd")
        packed_context_parallel_layout(torch.zeros(4, 2, 8), psp, object())


def test_single_rank_layout_is_the_plain_path():
    """group None: size 1, the layer runs its ordinary path on the global layout (bitwise the same output)."""
    from dsv4_attention import AttentionConfig, DSv4Attention
    from dsv4_attention.cp import context_parallel_layout

    glob = pack_layout([10, 3], None, 14)
    cpl = context_parallel_layout(glob, None)
    assert (cpl.size, cpl.rank, cpl.local_start, cpl.local_stop, cpl.is_parallel) == (1, 0, 0, 14, False)
    torch.testing.assert_close(cpl.local_positions, glob.positions, rtol=0, atol=0)
    kind = LayerKind.WINDOW
    torch.manual_seed(0)
    cfg = AttentionConfig(kind, 16, 2, 8, 8, 2, 4, 4, rope_config_for_kind(kind, 4))
    m = DSv4Attention(cfg)
    x = torch.randn(14, 16)
    torch.testing.assert_close(m(x, cpl)[0], m(x, glob)[0], rtol=0, atol=0)


def test_cp_topk_refuses_torch_topk_ties():
    from dsv4_attention import IndexerConfig, LightningIndexer
    from dsv4_attention.cp.indexer import select_topk

    cfg = IndexerConfig(hidden_size=16, q_lora_rank=8, n_heads=2, head_dim=8, topk=2, tie_break="torch_topk")
    indexer = LightningIndexer(cfg, rope_config_for_kind(LayerKind.CSA, 4))
    with pytest.raises(ValueError, match="'lower_index' only"):
        select_topk(
            indexer, None, torch.zeros(0, 8), torch.zeros(1, 0, dtype=torch.int32), "reference", False
        )


@pytest.mark.parametrize("chunk", [1 << 24, 7])
def test_cp_topk_equals_cp1_rows(monkeypatch, chunk):
    """Local-query top-k against the global keys (row tiles forced small too) = CP=1's ``indexer_topk`` rows,
    ties (exact zeros of the ReLU scores) included."""
    from csa_kernels import indexer_topk
    from dsv4_attention import IndexerConfig, LightningIndexer
    from dsv4_attention.cp import indexer as cp_indexer

    monkeypatch.setattr(cp_indexer, "_CHUNK_ELEMENTS", chunk)
    glob = pack_layout([13, 0, 3, 20, 9], [13, 0, 5, 22, 9], 52)
    cfg = IndexerConfig(hidden_size=16, q_lora_rank=8, n_heads=2, head_dim=8, topk=3)
    indexer = LightningIndexer(cfg, rope_config_for_kind(LayerKind.CSA, 4))
    torch.manual_seed(0)
    tc = glob.compressed_bounds_host(4)[-1]
    q, k, w = torch.randn(52, 2, 8), torch.randn(tc, 8), torch.randn(52, 2).abs()
    ref_idx, ref_val = indexer_topk(q, k, w, 4, 3, glob.cu_seqlens, _cu_c(glob, 4), backend="reference")
    for r in range(4):
        cpl = ContextParallelLayout(glob, None, r, 4)
        sl = slice(cpl.local_start, cpl.local_stop)
        iq = cp_indexer.LocalIndexerQueries(q[sl], w[sl])
        idx, val = cp_indexer.select_topk(indexer, iq, k, cpl.plan(8, 4, True).visible, "reference", True)
        torch.testing.assert_close(idx, ref_idx[sl], rtol=0, atol=0)
        torch.testing.assert_close(val, ref_val[sl], rtol=1e-6, atol=1e-6)
