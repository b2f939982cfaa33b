"""The attention plan of the one forward: a token layout (or a single-rank CP layout) is the trivial plan, a CP
layout of size > 1 gives the rank's ``ContextParallelPlan`` over the kind's cached ``KindPlan`` (single process:
ranks simulated without a group, no collective is called)."""

from __future__ import annotations

import pytest
import torch
from _cp_cases import pack_layout

from dsv4_attention import LayerKind
from dsv4_attention._kernels import window_indices
from dsv4_attention.attention_plan import SingleRankPlan, attention_plan
from dsv4_attention.cp import ContextParallelLayout, ContextParallelPlan


def test_a_token_layout_is_the_trivial_plan():
    glob = pack_layout([13, 0, 3, 20], [13, 0, 5, 22], 48)
    for layout in (glob, ContextParallelLayout(glob, None, 0, 1)):
        plan = attention_plan(layout, LayerKind.CSA, 8)
        assert isinstance(plan, SingleRankPlan) and plan.layout is glob
        assert (plan.halo, plan.is_parallel, plan.group) == (0, False, None)
        x = torch.randn(48, 4)
        assert plan.key_rows(x) is x  # no communication, identity maps
        torch.testing.assert_close(plan.query_positions, glob.rope_positions, rtol=0, atol=0)
        torch.testing.assert_close(plan.window_indices(), window_indices(glob.bounds, 8), rtol=0, atol=0)
        rows = torch.tensor([True, False, True])
        assert int(plan.loss_count(rows)) == 2  # the local count: the mean
        assert attention_plan(plan, LayerKind.CSA, 8) is plan


def test_a_cp_rank_gets_its_kind_plan_and_the_global_loss_count():
    glob = pack_layout([13, 0, 3, 20], [13, 0, 5, 22], 48)
    counts = []
    for r in range(4):
        cpl = ContextParallelLayout(glob, None, r, 4)
        plan = attention_plan(cpl, LayerKind.CSA, 8)
        kp = cpl.plan(8, 4, True)
        assert isinstance(plan, ContextParallelPlan) and plan.kind_plan is kp and plan.is_parallel
        assert plan.halo == kp.halo and plan.window_indices() is kp.window
        torch.testing.assert_close(plan.key_positions, kp.ext_positions, rtol=0, atol=0)
        counts.append(int(plan.loss_count(torch.ones(12, dtype=torch.bool))))
        with pytest.raises(ValueError, match=f"rank {r} expects its 12 local rows"):
            plan.key_rows(torch.zeros(13, 4))
    real = (glob.positions >= 3) & glob.real_rows  # real rows with a visible ratio-4 entry
    assert counts == [int(real.sum())] * 4  # every rank divides by the same global count
