"""The lightning indexer under CP (D8): local queries scored against every visible compressed key of their segment.

Keys ``KI [Tc, c_I]`` are the gathered global indexer entries (CP=1's ids); each local query's candidates are the
contiguous visible ids ``[entry_start, entry_start + num_visible)`` of its segment (``w < floor((p+1)/4)``, from the
:class:`~dsv4_attention.cp.plan.KindPlan`). Scores come from csa-kernels' ``indexer_scores_at`` (the same
``sum_h w[t,h] relu(<qI[t,h], KI[s]>)``). The top-k STREAMS (:func:`stream_topk`): chunks of rows, tiles of
candidate columns, merged into a running top-k, so neither an ``[L, max_c]`` candidate map nor ``[L, max_c]``
scores are formed (memory ``O(L * k)`` plus one bounded tile, like CP=1's streaming ``indexer_topk``). Tie rule =
csa-kernels' ``lower_index`` (ties -> lower entry id, exactly), ``-1`` / ``-inf`` in the trailing slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_attention._kernels import indexer_scores_at
from dsv4_attention.indexer import LightningIndexer


@dataclass
class LocalIndexerQueries:
    """Local indexer queries ``q [L, n_I, c_I]`` and scaled weights ``w [L, n_I]`` (``LightningIndexer.queries`` of
    the local rows)."""

    q: torch.Tensor
    weights: torch.Tensor


def scores_at(iq: LocalIndexerQueries, keys: torch.Tensor, ids: torch.Tensor, backend: str) -> torch.Tensor:
    """Differentiable scores ``[L, K]`` at global entry ids ``[L, K]`` (``-inf`` at -1)."""
    return indexer_scores_at(iq.q, keys, iq.weights, ids, backend=backend, check_indices=False)


def select_topk(
    indexer: LightningIndexer,
    iq: LocalIndexerQueries,
    keys: torch.Tensor,
    plan,
    backend: str,
    with_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [L, k] int32 global entry ids, -1 trailing; scores [L, k])`` (scores differentiable when
    ``with_grad``) over each local query's visible range of ``plan``
    (a :class:`~dsv4_attention.cp.plan.KindPlan`), streamed (module docstring)."""
    if indexer.cfg.tie_break != "lower_index":
        raise ValueError(
            f"IndexerConfig.tie_break={indexer.cfg.tie_break!r} is a CPU-parity rule for single-rank runs; context "
            "parallelism supports tie_break='lower_index' only"
        )
    with torch.no_grad():
        idx, vals = stream_topk(iq, keys, plan, indexer.topk, backend)
    if with_grad:
        vals = scores_at(iq, keys, idx, backend)  # [L, k] the sparse-loss student
    return idx, vals


ENTRY_TILE = 4096  # candidate columns scored per merge step
TILE_ELEMENTS = 1 << 24  # bound of one merge buffer [rows, k + ENTRY_TILE] (rows per chunk follow from it)


def stream_topk(iq: LocalIndexerQueries, keys: torch.Tensor, plan, k: int, backend: str):
    """Top-k of every local row over its visible range, ``(indices [L, k] int32, scores [L, k])`` (no autograd).

    Rows in chunks of ``max(1, TILE_ELEMENTS // (k + ENTRY_TILE))``; per chunk the columns ``j < max visible`` of
    the chunk (a host bound) in tiles of ``ENTRY_TILE``, candidate ``j`` = entry ``entry_start + j`` where
    ``j < num_visible`` (else -1, score ``-inf``), merged into the running best by a stable descending sort of
    ``cat(best, tile)``: ``best`` is kept in (score descending, id ascending) order and holds lower ids than the
    tile, so equal scores keep the lower id (CP=1's ``lower_index`` rule, exactly). ``+ 0.0`` makes ``-0.0`` equal
    ``+0.0`` for any sort. Memory: the outputs plus one ``[rows, k + ENTRY_TILE]`` buffer (scores, ids, order) and
    the score op's own bounded temporaries, whatever the number of visible entries.
    """
    big_l = iq.q.shape[0]
    dev = iq.q.device
    fp64 = torch.float64 in (iq.q.dtype, keys.dtype, iq.weights.dtype)
    idx = torch.full((big_l, k), -1, dtype=torch.int32, device=dev)
    vals = torch.full((big_l, k), float("-inf"), dtype=torch.float64 if fp64 else torch.float32, device=dev)
    rows = max(1, TILE_ELEMENTS // (k + ENTRY_TILE))
    for lo in range(0, big_l, rows):
        hi = min(big_l, lo + rows)
        width = plan.max_visible(lo, hi)  # host int
        if width == 0:
            continue
        q_part = LocalIndexerQueries(iq.q[lo:hi], iq.weights[lo:hi])
        first, count = plan.entry_start[lo:hi, None], plan.num_visible[lo:hi, None]  # [n, 1]
        best_v = best_i = None
        for c0 in range(0, width, ENTRY_TILE):
            cols = torch.arange(c0, min(width, c0 + ENTRY_TILE), device=dev)
            ids = torch.where(cols < count, first + cols, -1).to(torch.int32)  # [n, E] candidate ids
            cand = scores_at(q_part, keys, ids, backend) + 0.0  # [n, E] (-inf at -1)
            if best_v is not None:
                cand, ids = torch.cat((best_v, cand), 1), torch.cat((best_i, ids), 1)
            cand, order = torch.sort(cand, dim=1, descending=True, stable=True)
            best_v, best_i = cand[:, :k], ids.gather(1, order[:, :k])
        m = best_v.shape[1]
        idx[lo:hi, :m] = torch.where(torch.isneginf(best_v), -1, best_i)
        vals[lo:hi, :m] = best_v
    return idx, vals
