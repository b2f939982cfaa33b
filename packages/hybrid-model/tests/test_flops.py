"""FLOP formulas (upstream D9) against brute-force enumeration."""

import pytest

from hybrid_model.flops import (
    forward_flops,
    forward_flops_from_stats,
    forward_flops_sbhd,
    selected_entries_sum,
    visible_entries_sum,
    window_pairs,
)
from hybrid_model.presets import get_preset


@pytest.mark.parametrize("L", [0, 1, 3, 7, 8, 9, 16, 37, 64, 100, 257])
@pytest.mark.parametrize(("m", "k", "W"), [(4, 4, 8), (8, 2, 8), (4, 512, 128), (128, 3, 128)])
def test_pair_counts_match_enumeration(L, m, k, W):
    win = sum(1 for t in range(L) for s in range(L) if t - W < s <= t)
    visible = [sum(1 for w in range(L // m) if (w + 1) * m <= t + 1) for t in range(L)]
    assert window_pairs(L, W) == win
    assert visible_entries_sum(L, m) == sum(visible)
    assert selected_entries_sum(L, m, k) == sum(min(k, v) for v in visible)


def test_sbhd_is_sum_of_documents_and_linear_in_batch():
    cfg = get_preset("tiny")
    one = forward_flops_sbhd(cfg, 37)
    three = forward_flops_sbhd(cfg, 37, batch=3)
    assert three.forward == pytest.approx(3 * one.forward)
    mixed = forward_flops(cfg, [37, 5, 100])
    assert mixed.forward == pytest.approx(
        one.forward + forward_flops_sbhd(cfg, 5).forward + forward_flops_sbhd(cfg, 100).forward
    )
    assert three.training == pytest.approx(3 * three.forward)


def test_dense_phase_counts_all_visible_csa_entries():
    cfg = get_preset("tiny")
    sparse, dense = forward_flops_sbhd(cfg, 100), forward_flops_sbhd(cfg, 100, dense=True)
    assert dense.components["attention.csa_core"] > sparse.components["attention.csa_core"]
    short_s, short_d = forward_flops_sbhd(cfg, 16), forward_flops_sbhd(cfg, 16, dense=True)
    assert short_s.forward == short_d.forward  # T <= m*k: every visible entry is selected (oracle I2)


def test_stats_form_close_to_exact_for_long_documents():
    cfg = get_preset("v4-flash")
    lengths = [65536, 32768, 16384]
    exact = forward_flops(cfg, lengths)
    approx = forward_flops_from_stats(cfg, sum(lengths), sum(x * x for x in lengths))
    assert approx.forward >= exact.forward
    assert approx.forward == pytest.approx(exact.forward, rel=0.01)


def test_mfu_and_validation():
    cfg = get_preset("flash-smoke")
    br = forward_flops_sbhd(cfg, 4096)
    assert br.mfu(1.0, br.training) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        br.mfu(0.0, 1e15)
    with pytest.raises(ValueError):
        forward_flops_sbhd(cfg, 0)
    with pytest.raises(ValueError):
        forward_flops_from_stats(cfg, 10, 5)


def test_cp_rank_flops_add_up_to_the_pack():
    """Under contiguous CP the ranks' exact shares add up to the whole pack's FLOPs (documents crossing rank edges,
    per-document padding, an empty document, a static tail), later ranks pay more attention (causal), and CP=1 is
    the pack itself."""
    from hybrid_model.flops import forward_flops_cp_rank

    cfg = get_preset("tiny")
    lengths, padded = [300, 0, 41, 700], [304, 0, 48, 700]
    total = 1104  # 1052 padded rows + a tail of 52
    for dense in (False, True):
        whole = forward_flops(cfg, lengths, dense=dense)
        for cp in (1, 2, 4):
            parts = [
                forward_flops_cp_rank(
                    cfg, lengths, padded, total_tokens=total, cp_rank=r, cp_size=cp, dense=dense
                )
                for r in range(cp)
            ]
            assert sum(p.tokens for p in parts) == whole.tokens == sum(lengths)
            for key, value in whole.components.items():
                assert sum(p.components.get(key, 0.0) for p in parts) == pytest.approx(value, rel=1e-12), key
        two = [
            forward_flops_cp_rank(cfg, [552], [552], total_tokens=552, cp_rank=r, cp_size=2) for r in (0, 1)
        ]
        assert two[0].tokens == two[1].tokens
        assert two[0].components["attention.hca_core"] < two[1].components["attention.hca_core"]
    with pytest.raises(ValueError, match="multiple of cp_size"):
        forward_flops_cp_rank(cfg, [5], [5], total_tokens=5, cp_rank=0, cp_size=2)
    with pytest.raises(ValueError, match="exceed total_tokens"):
        forward_flops_cp_rank(cfg, [5], [8], total_tokens=6, cp_rank=0, cp_size=2)
