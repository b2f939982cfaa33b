"""megatron-core's all-to-all token dispatcher, made exact for routing maps with unrouted (padding) rows.

megatron-core 0.19.2's dropless ``MoEAlltoAllTokenDispatcher.preprocess`` sizes the first permutation statically,
``num_out_tokens = num_tokens * topk``: it assumes every routing-map row selects exactly ``topk`` experts (its own
routers dispatch padding tokens). DSv4 routers give padding tokens an all-False row, so they are never dispatched.
With padding the argsort-based ``permute`` then emitted ``num_tokens * topk`` rows (the routed ones followed by
``topk · #padding`` unrouted filler rows) while the per-expert counts, the all-to-all splits and the chunk sort
counted only the routed ones, e.g. ``sort_chunks_by_idxs``: "split_sizes [27, 35, 40, 36] (138) vs 148 rows" at
EP=1, a split-size mismatch in the all-to-all at EP>1, and filler rows handed to a single local expert.

:class:`DSv4AlltoAllTokenDispatcher` sizes the permutation by the routing map's population count whenever the
layer says rows may be empty (:attr:`~DSv4AlltoAllTokenDispatcher.may_have_unrouted_tokens`, set per forward by
:class:`~hash_moe.megatron.DSv4MoELayer` when a padding mask is given), syncing that count to the host before the
first permutation, the same mechanism megatron uses for capacity-dropping. Without padding nothing changes: the
static count and megatron's own sync point are kept.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

_FIRST_SYNC_POINT = "before_permutation_1"


class DSv4AlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher; padding tokens (all-False routing rows) are neither permuted nor sent.

    Same constructor and behaviour as ``MoEAlltoAllTokenDispatcher``, plus the per-forward flag
    ``may_have_unrouted_tokens`` (False by default).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.may_have_unrouted_tokens = False

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        """megatron's preprocess; with unrouted rows, the permutation size is the number of routed (token, expert)."""
        # megatron only ever moves the sync point earlier; restart from "no_sync" each call so that a padded batch
        # does not leave the earlier sync behind for later unpadded ones (megatron re-derives its own points here)
        self.cuda_sync_point = "no_sync"
        tokens_per_local_expert = super().preprocess(routing_map)
        if self.may_have_unrouted_tokens and not self.drop_and_pad:
            if self.cuda_dtoh_point != _FIRST_SYNC_POINT:
                raise ValueError(
                    "padding tokens with a CUDA-graphed MoE preprocess are not supported: the number of routed "
                    "tokens is data dependent. Drop 'moe_preprocess' from cuda_graph_modules (or pass no "
                    "padding_mask)"
                )
            # routed (token, expert) pairs; copied to the host at the first sync point, as for capacity dropping
            self.num_out_tokens = routing_map.sum()
            self._maybe_update_cuda_sync_point(_FIRST_SYNC_POINT)
        return tokens_per_local_expert
