"""Single-process tests of the CP index maps (D7): every rank's view simulated from the global layout.

For random packs (empty documents, padding, static tail) and CP sizes 2..5: the window rows, the visible compressed
ids, the entry ownership (a partition of CP=1's ids, each owned by the rank holding its last token, within the
static capacity) and the logical id -> gathered row map; and the owned entries computed by each simulated rank from
its extended rows alone equal CP=1's compressor output rows exactly (the zero-row realignment of clipped groups).
"""

from __future__ import annotations

import copy
import itertools
import random
import weakref
from types import SimpleNamespace

import pytest
import torch
from _cp_cases import pack_layout
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dsv4_attention import Compressor, CompressorConfig, LayerKind, rope_config_for_kind
from dsv4_attention._kernels import visible_compressed_indices, window_indices
from dsv4_attention.cp import ContextParallelLayout, halo_rows, owned_before
from dsv4_attention.cp.compressed import owned_entries
from dsv4_testkit import assert_close_to_ref


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
        win_ref = window_indices(glob.bounds, window)  # [T, W] global rows
        if ratio:
            vis_ref = visible_compressed_indices(glob.bounds, ratio, glob.max_compressed_entries(ratio))
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
            g0 = owned_before(list(glob.bounds.host), ratio, ls)
            owners += [r] * n_own
            slots += list(range(g0, g0 + n_own))
        if ratio:
            tc = glob.bounds.compressed(ratio).total
            assert slots == list(range(tc))  # the owned ranges partition CP=1's ids in order
            gather = ContextParallelLayout(glob, None, 0, p).plan(window, ratio, overlap).gather_rows
            cap = glob.num_tokens // p // ratio + 1
            assert (gather // cap).tolist() == owners
            # every owner holds the entry's last token
            last = _entry_last_rows(glob, ratio)
            assert (last // (glob.num_tokens // p)).tolist() == owners


def _entry_last_rows(glob, ratio):
    out = []
    bounds = list(glob.bounds.host)
    for s, e in itertools.pairwise(bounds):
        out += [s + (w + 1) * ratio - 1 for w in range((e - s) // ratio)]
    return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize("kind", [LayerKind.CSA, LayerKind.HCA])
def test_owned_entries_equal_cp1_compressor(kind):
    """Each simulated rank pools its owned entries from its extended rows only: CP=1's entries, within the
    tolerance rule against an fp64 CP=1 run (not bitwise: the projections of fewer rows may take another BLAS
    blocking, which rounds differently on some CPUs; measured 4.5e-8 on an AMD EPYC)."""
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
        ref, _ = comp(x, glob.bounds, backend="reference", max_position=glob.max_rope_position)
        ref64, _ = copy.deepcopy(comp).double()(
            x.double(), glob.bounds, backend="reference", max_position=glob.max_rope_position
        )
        for p in (2, 4):
            parts = []
            for r in range(p):
                cpl = ContextParallelLayout(glob, None, r, p)
                plan = cpl.plan(8, ratio, kind.overlap)
                x_ext = x[cpl.local_start - plan.halo : cpl.local_stop]
                own = owned_entries(comp, x_ext, plan, glob.max_rope_position, "reference")
                parts.append(own)
            gathered = torch.cat(parts)[plan.gather_rows]
            assert_close_to_ref(f"{kind.name} p={p} owned entries", gathered, ref64, ref_same_dtype=ref)


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
    plan = ContextParallelLayout(pack_layout([8], None, 8), None, 0, 1).plan(8, 4, True)
    with pytest.raises(ValueError, match="'lower_index' only"):
        select_topk(indexer, None, torch.zeros(0, 8), plan, "reference", False)


TOPK_PACK = ([13, 0, 3, 20, 9], [13, 0, 5, 22, 9], 52)  # CP=4: L = 13; documents cross rank boundaries


def _topk_inputs(ties: bool):
    """``(q [52, 2, 8], k [Tc, 8], w [52, 2])``; ``ties``: small integers and 3 distinct key rows, so the scores are
    exact integers in any summation order and most of them tie (zeros of the ReLU included)."""
    glob = pack_layout(*TOPK_PACK)
    tc = glob.bounds.compressed(4).total
    g = torch.Generator().manual_seed(0)
    if not ties:
        return (
            torch.randn(52, 2, 8, generator=g),
            torch.randn(tc, 8, generator=g),
            torch.rand(52, 2, generator=g),
        )
    keys = torch.randint(-1, 2, (3, 8), generator=g).float()[torch.randint(0, 3, (tc,), generator=g)]
    q = torch.randint(-2, 3, (52, 2, 8), generator=g).float()
    return q, keys, torch.randint(0, 3, (52, 2), generator=g).float()


@pytest.mark.parametrize("ties", [False, True], ids=["random", "tie_heavy"])
@pytest.mark.parametrize("tile,elements", [(4096, 1 << 24), (2, 10), (3, 30)], ids=["one_tile", "1x2", "5x3"])
def test_cp_topk_equals_cp1_rows(monkeypatch, tile, elements, ties):
    """Streaming local-query top-k against the global keys = CP=1's ``indexer_topk`` rows, exactly.

    Tiles: one (default sizes), or chunks of ``TILE_ELEMENTS // (k + ENTRY_TILE)`` = 2 / 5 rows and 2 / 3 candidate
    columns, so chunk boundaries split documents (asserted) and tile boundaries split a row's candidates: the merge
    must keep CP=1's tie rule (lower entry id) across tiles. ``tie_heavy``: integer scores, most of them tied."""
    from csa_kernels import indexer_topk
    from dsv4_attention import IndexerConfig, LightningIndexer
    from dsv4_attention.cp import indexer as cp_indexer

    monkeypatch.setattr(cp_indexer, "ENTRY_TILE", tile)
    monkeypatch.setattr(cp_indexer, "TILE_ELEMENTS", elements)
    glob = pack_layout(*TOPK_PACK)
    topk = 3
    cfg = IndexerConfig(hidden_size=16, q_lora_rank=8, n_heads=2, head_dim=8, topk=topk)
    indexer = LightningIndexer(cfg, rope_config_for_kind(LayerKind.CSA, 4))
    q, k, w = _topk_inputs(ties)
    ref_idx, ref_val = indexer_topk(q, k, w, 4, topk, glob.bounds, backend="reference")
    if ties:  # many rows have tied scores inside their top-k or across its boundary
        s = cp_indexer.scores_at(cp_indexer.LocalIndexerQueries(q, w), k, _visible_all(glob), "reference")
        kth = ref_val[:, topk - 1 : topk]
        assert int(((s == kth) & torch.isfinite(kth)).sum(1).gt(1).sum()) >= 10
    rows = max(1, elements // (topk + tile))
    split = False
    for r in range(4):
        cpl = ContextParallelLayout(glob, None, r, 4)
        sl = slice(cpl.local_start, cpl.local_stop)
        for lo in range(rows, cpl.num_local_tokens, rows):  # a chunk boundary inside a document
            g = cpl.local_start + lo
            split |= any(s < g < e for s, e in itertools.pairwise(glob.bounds.host))
        iq = cp_indexer.LocalIndexerQueries(q[sl].clone().requires_grad_(True), w[sl])
        plan = cpl.plan(8, 4, True)
        idx, val = cp_indexer.select_topk(indexer, iq, k, plan, "reference", True)
        torch.testing.assert_close(idx, ref_idx[sl], rtol=0, atol=0)
        torch.testing.assert_close(val, ref_val[sl], rtol=0 if ties else 1e-6, atol=0 if ties else 1e-6)
        assert val.requires_grad  # the sparse-loss student: gradients through the scores as before
    assert split == (rows < 13)


def _visible_all(glob):
    return visible_compressed_indices(glob.bounds, 4, glob.max_compressed_entries(4))


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created inside the mode and still alive (views counted once; storages of
    tensors created before entering are not counted)."""

    def __init__(self):
        super().__init__()
        self.owners: dict[int, list] = {}  # data_ptr -> [nbytes, live tensors]
        self.live = self.peak = 0

    def _drop(self, ptr: int) -> None:
        entry = self.owners[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.owners[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        before = {
            a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in self.owners:
                self.owners[ptr][1] += 1
            elif ptr in before:  # a view of a tensor from before the mode
                continue
            else:
                self.owners[ptr] = [t.untyped_storage().nbytes(), 1]
                self.live += self.owners[ptr][0]
                self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._drop, ptr)
        return out


def test_cp_topk_memory_is_local_rows_times_k(monkeypatch):
    """The selection's live temporaries do not grow with the visible candidates ``n``: the last rank (``L = 16``
    rows at the end of one long document) keeps the same peak at ``max_c = 256`` and ``2048`` entries, within
    ``4 x`` the ``[L, k]`` outputs plus ``2 x`` one chunk's tile; the old ``[L, max_c]`` int32 candidate map alone
    exceeds that bound at ``max_c = 2048``, and the same counter sees it when the map is built (``plan.visible``,
    the dense phase's)."""
    from dsv4_attention import IndexerConfig, LightningIndexer
    from dsv4_attention.cp import indexer as cp_indexer

    tile, topk, big_l, heads, dim = 32, 4, 16, 1, 4
    monkeypatch.setattr(cp_indexer, "ENTRY_TILE", tile)
    monkeypatch.setattr(cp_indexer, "TILE_ELEMENTS", big_l * (topk + tile))  # one chunk of L rows
    # one chunk's tile: scores / candidate ids / sort order [L, k + tile] (4 + 4 + 8 bytes) and the reference score
    # op's gathered keys [L, tile, c_I] + dots [L, n_I, tile] (fp32)
    chunk = big_l * (topk + tile) * (4 + 4 + 8) + big_l * tile * (dim + heads) * 4
    bound = 4 * big_l * topk * (4 + 4) + 2 * chunk
    cfg = IndexerConfig(hidden_size=16, q_lora_rank=8, n_heads=heads, head_dim=dim, topk=topk)
    indexer = LightningIndexer(cfg, rope_config_for_kind(LayerKind.CSA, 4))
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # 72 tiny tiles: intra-op threads only add overhead here (the counts do not change)
    try:
        peaks = [_topk_peak(indexer, doc, big_l, heads, dim, g, bound) for doc in (1024, 8192)]
    finally:
        torch.set_num_threads(threads)
    assert peaks[1] == peaks[0]  # independent of n
    assert big_l * (8192 // 4) * 4 > bound  # the old map violates the bound at this n


def _topk_peak(indexer, doc, big_l, heads, dim, g, bound):
    """Peak live bytes of the last rank's selection on one document of ``doc`` rows (``L = big_l``)."""
    from dsv4_attention.cp import indexer as cp_indexer

    glob = pack_layout([doc], None, doc)
    p = doc // big_l
    plan = ContextParallelLayout(glob, None, p - 1, p).plan(8, 4, True)
    max_c = plan.max_entries
    assert plan.max_visible(0, big_l) == max_c == doc // 4
    q, w = torch.randn(big_l, heads, dim, generator=g), torch.rand(big_l, heads, generator=g)
    keys = torch.randn(max_c, dim, generator=g)
    with _LiveBytes() as counter:
        idx, _ = cp_indexer.select_topk(
            indexer, cp_indexer.LocalIndexerQueries(q, w), keys, plan, "reference", False
        )
    assert (idx >= 0).all()
    assert counter.peak <= bound, (doc, counter.peak, bound)
    peak = counter.peak
    with _LiveBytes() as counter:
        assert plan.visible.shape == (big_l, max_c)
    assert counter.peak >= big_l * max_c * 4
    return peak
