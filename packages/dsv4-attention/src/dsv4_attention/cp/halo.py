"""Left halo exchange of static contiguous CP (D7): the ``d`` hidden rows left of every rank's slice.

Implementation: one autograd all-gather of every rank's last ``m = min(d, L)`` rows (rank-major ``[P*m, d_model]``);
rank ``r`` keeps global rows ``[max(ls - d, 0), ls)``. When ``L >= d`` they are rank ``r-1``'s tail; when ``L < d``
every tail is a whole shard, so the gathered buffer is the whole prefix and the halo spans several ranks (multi-hop
for free: shards SHORTER than the halo work). Backward: the gathered gradient is summed over ranks and each rank
keeps its own tail's slice (reduce-scatter; all-reduce + slice on gloo), so halo gradients reach their owners.
Volume per call: every rank receives ``(P - 1) * m * d_model`` elements (a P2P exchange would receive ``d *
d_model``; the all-gather is chosen for its multi-hop support and one collective instead of a send/recv chain).
"""

from __future__ import annotations

import torch

from dsv4_attention.cp.comm import all_gather_rows


def exchange_halo(x: torch.Tensor, halo_request: int, halo: int, cpl) -> torch.Tensor:
    """``x [L, *]`` local rows -> ``cat(halo rows, x) [h + L, *]`` (``h = halo``, of ``halo_request`` asked)."""
    if halo_request == 0:
        return x
    big_l = x.shape[0]
    m = min(halo_request, big_l)
    tails = all_gather_rows(x[big_l - m :], cpl.group)  # [P*m, *] rank-major
    # rank 0 (no halo) still takes an empty slice: every rank's graph holds the gather, so every rank joins its
    # backward collective
    if m == big_l:  # every tail is a whole shard: tails = global rows [0, P*L)
        left = tails[cpl.local_start - halo : cpl.local_start]
    else:  # tails of rank r-1 = global rows [ls - m, ls), m = d >= h
        left = tails[max(cpl.rank - 1, 0) * m : cpl.rank * m][m - halo :] if halo else tails[:0]
    return torch.cat((left, x), 0)
