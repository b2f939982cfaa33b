"""Test helpers: the naive packed-roll reference and the gloo CP roll worker (module level, so spawn can pickle it)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def naive_roll_left(x: torch.Tensor, cu_padded, shifts: int = 1, fill=0) -> torch.Tensor:
    """Row-by-row reference of the packed roll along dim 0 (plain Python loop over padded documents)."""
    cu = [int(c) for c in cu_padded]
    out = torch.full_like(x, fill)
    for d in range(len(cu) - 1):
        for g in range(cu[d], cu[d + 1]):
            if g + shifts < cu[d + 1]:
                out[g] = x[g + shifts]
    return out


def _run_cases(group: dist.ProcessGroup, cases: list) -> list:
    from thd_packing import roll_left_contiguous_cp, shard_contiguous_cp

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    results = []
    for case in cases:
        local = shard_contiguous_cp(case["x"], rank, size, dim=case["dim"]).clone()
        if local.dtype.is_floating_point:
            local.requires_grad_(True)
        out = roll_left_contiguous_cp(
            local, case["cu"], group, shifts=case["shifts"], fill_value=case["fill"], dim=case["dim"]
        )
        grad = None
        if local.requires_grad:
            (out * case["weights"][rank]).sum().backward()
            grad = local.grad.detach()
        results.append((out.detach(), grad))
    return results


def cp_roll_worker(rank: int, world_size: int, cases_by_cp: dict) -> dict:
    """On 4 ranks: every CP=4 case on the whole group, every CP=2 case on the sub-groups {0,1} and {2,3}
    (so group ranks differ from global ranks). Returns {cp: per-case (local output, local input grad)}."""
    assert world_size == 4
    full = dist.new_group([0, 1, 2, 3])
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return {4: _run_cases(full, cases_by_cp[4]), 2: _run_cases(pairs[rank // 2], cases_by_cp[2])}
