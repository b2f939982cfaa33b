"""The context-parallel partial-loss rule (``dsv4_primitives.cp_partial_loss``): simulated CP ranks' partials add up
to the CP=1 masked mean, and CP=1 is the plain masked mean (single process; the all-reduced count over a real CP
group is exercised by dsv4-train's ``tests/test_context_parallel.py``)."""

from __future__ import annotations

import pytest
import torch

from dsv4_primitives.cp_partial_loss import (
    cp_partial_mean,
    cp_token_count,
    loss_denominator,
    partial_loss,
    partial_loss_gradient_scale,
    sum_partials,
)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_partials_of_the_ranks_add_up_to_the_cp1_mean(ranks):
    g = torch.Generator().manual_seed(0)
    per_token = torch.randn(1, 24, generator=g, dtype=torch.float64).requires_grad_(True)
    mask = (torch.rand(1, 24, generator=g) > 0.4).double()
    full = (per_token * mask).sum() / mask.sum()
    count = mask.sum()  # the global count every rank divides by
    rows = 24 // ranks
    parts = [
        partial_loss(
            (per_token[:, r * rows : (r + 1) * rows] * mask[:, r * rows : (r + 1) * rows]).sum(), count
        )
        for r in range(ranks)
    ]
    torch.testing.assert_close(sum(parts), full, rtol=1e-12, atol=0)
    (grad_parts,) = torch.autograd.grad(sum(parts), per_token)
    (grad_full,) = torch.autograd.grad(full, per_token)
    torch.testing.assert_close(grad_parts, grad_full, rtol=1e-12, atol=0)


def test_cp1_is_the_masked_mean_and_an_empty_mask_gives_zero():
    per_token = torch.tensor([[1.0, 2.0, 4.0, 8.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    assert float(cp_partial_mean(per_token, mask, None)) == 2.5
    assert float(cp_token_count(mask, None)) == 2.0
    zero = torch.zeros_like(mask)
    assert float(cp_partial_mean(per_token, zero, None)) == 0.0  # max(1, 0) rows: 0, not NaN
    assert float(loss_denominator(torch.tensor(0))) == 1.0
    assert int(partial_loss(torch.tensor(6), torch.tensor(3))) == 2  # integer counts (the attention's rows)


def test_without_a_group_the_sums_and_scale_are_identities():
    values = torch.tensor([0.5, 0.25])
    assert sum_partials(values, None) is values
    assert partial_loss_gradient_scale(None) == 1
