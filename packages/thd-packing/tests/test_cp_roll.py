"""Contiguous-CP packed roll over gloo (CP = 2 and 4) equals the single-rank roll, outputs and gradients."""

import pytest
import torch
from _thd_packing_helpers import cp_roll_worker

from dsv4_testkit import run_distributed
from thd_packing import roll_left, shard_contiguous_cp


def _cases(cp: int) -> list[dict]:
    g = torch.Generator().manual_seed(cp)
    specs = [
        # the upstream hand-built example: 7 + 11 tokens padded to 8 + 12 (a document straddles the rank edge)
        dict(cu=[0, 8, 20], t=20, shifts=1, dtype=torch.float64, fill=0.0, dim=0),
        # empty documents (repeated boundaries) on and next to rank edges, a tail past the last document
        dict(cu=[0, 0, 3, 3, 9, 9, 14, 14], t=16, shifts=1, dtype=torch.float64, fill=-1.0, dim=0),
        dict(cu=[0, 0, 3, 3, 9, 9, 14, 14], t=16, shifts=2, dtype=torch.float64, fill=0.0, dim=0),
        # one document spanning every rank, shift equal to the local length
        dict(cu=[0, 16], t=16, shifts=16 // cp, dtype=torch.float64, fill=0.0, dim=0),
        # documents ending exactly on rank edges
        dict(cu=[0, 4, 8, 12, 16], t=16, shifts=1, dtype=torch.float64, fill=0.0, dim=0),
        # integer labels, bool padding masks (fill True), a [B, T] tensor rolled along dim 1
        dict(cu=[0, 5, 5, 11], t=12, shifts=1, dtype=torch.int64, fill=0, dim=0),
        dict(cu=[0, 5, 5, 11], t=12, shifts=1, dtype=torch.bool, fill=True, dim=0),
        dict(cu=[0, 2, 9, 10], t=12, shifts=1, dtype=torch.float64, fill=0.0, dim=1),
    ]
    cases = []
    for s in specs:
        shape = (s["t"], 3) if s["dim"] == 0 else (2, s["t"])
        if s["dtype"] == torch.float64:
            x = torch.randn(shape, generator=g, dtype=torch.float64)
        elif s["dtype"] == torch.bool:
            x = torch.rand(shape, generator=g) > 0.5
        else:
            x = torch.randint(0, 100, shape, generator=g)
        w = torch.randn(shape, generator=g, dtype=torch.float64)
        weights = [shard_contiguous_cp(w, r, cp, dim=s["dim"]).clone() for r in range(cp)]
        cases.append(
            dict(
                x=x,
                cu=torch.tensor(s["cu"]),
                shifts=s["shifts"],
                fill=s["fill"],
                dim=s["dim"],
                weight=w,
                weights=weights,
            )
        )
    return cases


@pytest.fixture(scope="module")
def gloo_results():
    """One spawn of 4 gloo ranks serves both CP sizes (CP=2 runs on the sub-groups {0,1} and {2,3})."""
    cases = {cp: _cases(cp) for cp in (2, 4)}
    return cases, run_distributed(cp_roll_worker, 4, cases, timeout=300)


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
def test_contiguous_cp_roll_equals_single_rank(cp, gloo_results):
    cases, results = gloo_results
    # CP=2 runs twice (ranks {0,1} and {2,3}); both copies must match
    groups = [[0, 1, 2, 3]] if cp == 4 else [[0, 1], [2, 3]]
    for i, case in enumerate(cases[cp]):
        x, dim = case["x"], case["dim"]
        xr = x.clone().requires_grad_(x.dtype.is_floating_point)
        ref = roll_left(xr, case["cu"], shifts=case["shifts"], fill_value=case["fill"], dim=dim)
        if xr.requires_grad:
            (ref * case["weight"]).sum().backward()
        for ranks in groups:
            got = torch.cat([results[r][cp][i][0] for r in ranks], dim=dim)
            assert torch.equal(got, ref.detach()), f"case {i}: CP={cp} roll differs from the single-rank roll"
            if xr.requires_grad:
                grad = torch.cat([results[r][cp][i][1] for r in ranks], dim=dim)
                assert torch.allclose(grad, xr.grad, rtol=0, atol=1e-12), (
                    f"case {i}: CP={cp} gradient differs"
                )
