"""The fused row top-k of the streaming indexer (``ops/indexer/topk_select.py``) against a stable descending sort.

Candidates are ``cat([best, tile])`` with ``best`` in canonical order and holding lower ids than the tile; the
result must be the stable sort's first ``min(k, kb + n)`` (value descending, lower position first among ties),
with the values bit-exact (``-0.0`` kept) and, on the final merge, global int32 rows with ``-1`` at ``-inf``.
"""

from __future__ import annotations

import pytest
import torch

from csa_kernels.ops.indexer.topk_select import row_topk
from csa_kernels.ops.indexer.topk_streaming import canonical_order
from dsv4_testkit import interpreting

interpreter_only = pytest.mark.skipif(not interpreting(), reason="CPU interpreter case (gpu cases cover it)")

_VALUES = torch.tensor([-1.5, 0.0, -0.0, 2.0, float("-inf"), 0.5, -1.5, 3.0, 1e-30, -3.4e38])


def _case(rows, kb, n, seed, device="cpu"):
    """(best_v, best_i, tile, candidate values, candidate ids) with many exact ties, -inf and signed zeros."""
    gen = torch.Generator().manual_seed(seed)
    tile = _VALUES[torch.randint(0, len(_VALUES), (rows, n), generator=gen)]
    id0 = 100 + 2 * kb  # every id of best is below the tile's
    ids_t = torch.arange(id0, id0 + n).expand(rows, -1)
    if kb == 0:
        return None, None, tile.to(device), tile, ids_t, id0
    bv = _VALUES[torch.randint(0, len(_VALUES), (rows, kb), generator=gen)]
    bi = torch.stack([torch.randperm(id0, generator=gen)[:kb] for _ in range(rows)])
    bv, bi = canonical_order(bv, bi)
    return (
        bv.to(device),
        bi.to(device),
        tile.to(device),
        torch.cat([bv, tile], 1),
        torch.cat([bi, ids_t], 1),
        id0,
    )


def _expected(cand_v, cand_i, k):
    order = torch.sort(cand_v, dim=1, descending=True, stable=True).indices[:, :k]
    return cand_v.gather(1, order), cand_i.gather(1, order)


def _check(rows, kb, n, k, seed, device):
    bv, bi, tile, cand_v, cand_i, id0 = _case(rows, kb, n, seed, device)
    v, i = row_topk(bv, bi, tile, k, id0)
    rv, ri = _expected(cand_v, cand_i, k)
    assert v.shape == (rows, min(k, kb + n)) and i.dtype == torch.int64
    # bitwise values: -0.0 stays -0.0 (the sort treats it as equal to +0.0, so does the kernel)
    assert torch.equal(v.cpu().view(torch.int32), rv.view(torch.int32))
    assert torch.equal(i.cpu(), ri)
    # final merge: global rows entry0 + id, -1 where the value is -inf, written in place into wider outputs
    out_v = torch.full((rows, k + 3), float("-inf"), device=device)
    out_i = torch.full((rows, k + 3), -1, dtype=torch.int32, device=device)
    entry0 = torch.arange(rows, dtype=torch.int64, device=device) * 1000
    row_topk(bv, bi, tile, k, id0, (out_v, out_i, entry0))
    kk = rv.shape[1]
    want_i = torch.where(torch.isneginf(rv), -1, ri + entry0.cpu()[:, None]).to(torch.int32)
    assert torch.equal(out_i[:, :kk].cpu(), want_i) and torch.equal(out_v[:, :kk].cpu(), rv)
    assert bool((out_i[:, kk:] == -1).all()) and bool(torch.isneginf(out_v[:, kk:]).all())


@interpreter_only
@pytest.mark.parametrize(
    "rows,kb,n,k",
    [
        (5, 0, 37, 8),  # first tile, non-power-of-two width
        (4, 8, 20, 8),  # merge: running best + tile
        (3, 0, 5, 8),  # fewer candidates than k
        (6, 16, 40, 16),
        (3, 4, 1, 3),  # one-entry tile
        (2, 0, 1, 1),
        (3, 5, 11, 7),  # k not a power of two, kb < k
    ],
)
def test_row_topk_interpreter(rows, kb, n, k):
    _check(rows, kb, n, k, seed=rows * 100 + kb + n, device="cpu")


def test_row_topk_empty_rows_and_k():
    """No rows / nothing to select: empty results, no launch."""
    v, i = row_topk(None, None, torch.zeros(0, 5), 3, 0)
    assert v.shape == (0, 3) and i.shape == (0, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,kb,n,k", [(64, 0, 2048, 512), (32, 512, 3584, 512), (16, 100, 9, 50)])
def test_row_topk_gpu(rows, kb, n, k):
    _check(rows, kb, n, k, seed=7, device="cuda")
