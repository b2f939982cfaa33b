"""``IndexerCache``: a CSA layer's lightning-indexer keys per sequence and the top-k recomputed for every new row.

The indexer's compressed keys ``KI`` (its own ratio-4 overlapping compressor, spec §4.2) are cached like the main
entries (:class:`~dsv4_attention.decode.compressed.CompressorCache`, same ``[B, capacity]`` layout, so a key's global
row is its entry's). For each new row at position ``p`` (spec §4.2, the indexer's modules in ``forward``'s order)::

    qI     = RoPE(linear_wq_b(cQ).view(n_I, c_I), pos = p)                 # cQ: the layer's query latent
    wI     = linear_weights_proj(x) * c_I^-1/2 * n_I^-1/2
    I[s]   = sum_h wI[h] ReLU(<qI[h], KI[s]>)   for the visible s < floor((p + 1) / 4)   (csa-kernels indexer_scores_at)
    sel(p) = the top-k of I (:func:`select_topk`)

The selection is recomputed at every decoded token against every visible key (no selection is cached), exactly as
the training forward selects for that query.
"""

from __future__ import annotations

import torch

from dsv4_attention._kernels import indexer_scores_at
from dsv4_attention._linears import linear_out
from dsv4_attention._rope import rope
from dsv4_attention.decode.compressed import CompressorCache
from dsv4_attention.decode.plan import ExtendPlan
from dsv4_attention.indexer import LightningIndexer


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Columns ``[R, k]`` of the ``k`` highest finite ``scores [R, V]`` per row, in descending order.

    Spec §4.2 rule 2 (oracle I6), the rule of csa-kernels' ``indexer_topk`` (``tie_break="lower_index"``): equal
    scores keep the lower column first (a stable descending sort; the columns are entry ids in increasing order);
    ``-inf`` (invisible) is never selected; ``-1`` fills the trailing slots when fewer than ``k`` are finite.
    """
    vals, cols = torch.sort(scores, dim=1, descending=True, stable=True)
    vals, cols = vals[:, :k], cols[:, :k]
    cols = torch.where(torch.isneginf(vals), -1, cols)
    return torch.nn.functional.pad(cols, (0, k - cols.shape[1]), value=-1)


class IndexerCache:
    """The indexer compressor's :class:`CompressorCache` (keys ``[B, capacity, c_I]``) and the per-row top-k.

    Args:
        indexer: the layer's :class:`~dsv4_attention.indexer.LightningIndexer` (sizes only).
        batch, max_length, device, dtype: as :class:`CompressorCache`.
    """

    def __init__(
        self, indexer: LightningIndexer, batch: int, max_length: int, *, device=None, dtype=torch.float32
    ):
        if indexer.cfg.tie_break != "lower_index":
            raise ValueError(
                f"cached decoding selects the top-k with tie_break='lower_index' (spec §4.2 rule 2); this indexer "
                f"uses {indexer.cfg.tie_break!r} (CPU parity with transformers only): call "
                "indexer.set_tie_break('lower_index') first"
            )
        self.keys = CompressorCache(indexer.compressor, batch, max_length, device=device, dtype=dtype)

    def extend(
        self,
        indexer: LightningIndexer,
        x: torch.Tensor,
        plan: ExtendPlan,
        backend: str = "auto",
        *,
        undo: bool = False,
    ) -> None:
        """Consume the call's rows ``x [R, d]``: the keys of the blocks they complete (every call, dense phase too,
        so a later sparse step finds every key). ``undo``: as :meth:`CompressorCache.extend`."""
        self.keys.extend(indexer.compressor, x, plan, backend, undo=undo)

    def select(
        self,
        indexer: LightningIndexer,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        max_position: int,
        positions: torch.Tensor,
        visible: torch.Tensor,
        backend: str = "auto",
    ) -> torch.Tensor:
        """The entries selected for the call's rows (``x [R, d]``, ``q_latent [R, d_c]`` at ``positions [R]``,
        ``max_position`` a host bound of them; after :meth:`extend`): int64 ``[R, k]`` global rows of the ``[B * capacity]`` entry buffer (``-1`` = none).

        ``visible [R, V]``: every visible entry of each row in increasing order (``-1`` after), global rows.
        """
        k = indexer.topk
        if visible.shape[1] == 0:  # no complete block yet in any sequence
            return visible.new_full((visible.shape[0], k), -1)
        r = x.shape[0]
        q = linear_out(indexer.linear_wq_b, q_latent).view(r, indexer.n_heads, indexer.head_dim)
        q = rope(q, positions, indexer.rope_cfg, max_position=max_position)  # [R, n_I, c_I]
        w = linear_out(indexer.linear_weights_proj, x) * indexer.weight_scale  # [R, n_I]
        keys = self.keys.entries.view(-1, self.keys.entries.shape[-1])  # [B * capacity, c_I]
        scores = indexer_scores_at(q, keys, w, visible, backend=backend, check_indices=False)  # [R, V]
        cols = select_topk(scores, k)  # [R, k]
        return torch.where(cols >= 0, visible.gather(1, cols.clamp(min=0)), -1)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes
