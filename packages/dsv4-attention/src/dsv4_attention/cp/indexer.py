"""The lightning indexer under CP (D8): local queries scored against every visible compressed key of their segment.

Keys ``KI [Tc, c_I]`` are the gathered global indexer entries (CP=1's ids); each local query's candidates are its
visible ids ``plan.visible [L, max_c]`` (``w < floor((p+1)/4)`` of its segment). Scores come from csa-kernels'
``indexer_scores_at`` (the same ``sum_h w[t,h] relu(<qI[t,h], KI[s]>)``), so a rank forms at most ``[L, max_c]``
scores, never the whole sequence's (the top-k runs on row tiles of at most 2^24 candidate scores). Top-k = csa-kernels' ``lower_index`` rule: a stable descending sort over the
candidates in entry order (ties -> lower entry id), ``-1`` / ``-inf`` in the trailing slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_attention._kernels import indexer_scores_at
from dsv4_attention._linears import linear_out
from dsv4_attention._rope import rope
from dsv4_attention.indexer import LightningIndexer


@dataclass
class LocalIndexerQueries:
    """Local indexer queries ``q [L, n_I, c_I]`` and scaled weights ``w [L, n_I]``."""

    q: torch.Tensor
    weights: torch.Tensor


def local_queries(
    indexer: LightningIndexer,
    x: torch.Tensor,
    q_latent: torch.Tensor,
    positions: torch.Tensor,
    max_position: int,
) -> LocalIndexerQueries:
    """The indexer's query side on local rows (inputs detached, as at CP=1)."""
    t = x.shape[0]
    q = linear_out(indexer.linear_wq_b, q_latent.detach())  # [L, n_I*c_I]
    q = rope(
        q.view(t, indexer.n_heads, indexer.head_dim), positions, indexer.rope_cfg, max_position=max_position
    )
    w = linear_out(indexer.linear_weights_proj, x.detach())  # [L, n_I]
    return LocalIndexerQueries(q, w * indexer.weight_scale)


def scores_at(iq: LocalIndexerQueries, keys: torch.Tensor, ids: torch.Tensor, backend: str) -> torch.Tensor:
    """Differentiable scores ``[L, K]`` at global entry ids ``[L, K]`` (``-inf`` at -1)."""
    return indexer_scores_at(iq.q, keys, iq.weights, ids, backend=backend, check_indices=False)


def select_topk(
    indexer: LightningIndexer,
    iq: LocalIndexerQueries,
    keys: torch.Tensor,
    visible: torch.Tensor,
    backend: str,
    with_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [L, k] int32 global entry ids, -1 trailing; scores [L, k])`` (scores differentiable when
    ``with_grad``)."""
    if indexer.cfg.tie_break != "lower_index":
        raise ValueError(
            f"IndexerConfig.tie_break={indexer.cfg.tie_break!r} is a CPU-parity rule for single-rank runs; context "
            "parallelism supports tie_break='lower_index' only"
        )
    k = indexer.topk
    rows = max(1, _CHUNK_ELEMENTS // max(visible.shape[1], 1))  # bounded [rows, max_c] score tiles
    parts = []
    with torch.no_grad():
        for lo in range(0, visible.shape[0], rows):
            q_part = LocalIndexerQueries(iq.q[lo : lo + rows], iq.weights[lo : lo + rows])
            parts.append(_topk_rows(q_part, keys, visible[lo : lo + rows], k, backend))
    idx = torch.cat([p[0] for p in parts]) if parts else visible.new_full((0, k), -1)
    vals = torch.cat([p[1] for p in parts]) if parts else iq.weights.new_full((0, k), float("-inf"))
    if with_grad:
        vals = scores_at(iq, keys, idx, backend)  # [L, k] the sparse-loss student
    return idx, vals


_CHUNK_ELEMENTS = 1 << 24  # candidate scores per tile of the top-k (64 MiB of fp32)


def _topk_rows(iq: LocalIndexerQueries, keys, visible, k: int, backend: str):
    """Top-k of one tile of rows: ``(indices [n, k] int32, scores [n, k] fp32)``."""
    s = scores_at(iq, keys, visible, backend)  # [n, max_c]
    vals, cols = torch.sort(s, dim=1, descending=True, stable=True)
    vals, cols = vals[:, :k], cols[:, :k]
    idx = torch.where(torch.isneginf(vals), -1, visible.gather(1, cols).to(torch.int64))
    if idx.shape[1] < k:
        idx = torch.nn.functional.pad(idx, (0, k - idx.shape[1]), value=-1)
        vals = torch.nn.functional.pad(vals, (0, k - vals.shape[1]), value=float("-inf"))
    return idx.to(torch.int32), vals
