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

**Atomic-free permutation.** Where megatron would take its unfused, dropless path (``moe_permute_fusion=False``, no
``moe_pad_expert_input_to_capacity``, no ``moe_router_padding_for_quantization``, no CUDA-graphed preprocess), the
first permutation and its inverse are :func:`hash_moe.permute.permute` / :func:`~hash_moe.permute.unpermute`:
the same rows in the same order (bit-identical forward), but every direction is a gather (per-token fp32 sums over
the token's ``≤ topk`` rows) instead of megatron's ``index_select`` (``index_add_`` backward) and ``scatter_add_``,
both atomic and non-deterministic on CUDA. With one TP x EP rank the chunk sort after the all-to-all is the identity
permutation and is skipped (megatron still splits and concatenates). Everything else (metadata, sync points,
all-to-all, shared-expert hooks, shapes) is megatron's: these overrides call its methods. Setting
``atomic_free_permute = False`` on the dispatcher restores megatron's functions.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from hash_moe.permute import PermuteMap, permute, unpermute

_FIRST_SYNC_POINT = "before_permutation_1"


# per-forward attributes of megatron's dispatchers beyond ``cudagraph_attrs`` (the all-gather dispatcher has none)
_FORWARD_STATE = (
    "routing_map",
    "probs",
    "local_probs",
    "local_map",
    "reversed_local_input_permutation_mapping",
    "permute_map",
)


def release_dispatcher_state(dispatcher) -> int:
    """Drop a token dispatcher's last-forward routing state once its backward is done (between training steps):
    every tensor among megatron's per-forward attributes (``cudagraph_attrs`` where the dispatcher has them: the
    routing map, probabilities, permutation mapping, split sizes; dotted names reach the shared experts; plus the
    all-gather dispatcher's maps and :class:`DSv4AlltoAllTokenDispatcher`'s ``permute_map``). They are
    sequence-sized (``[T, E]`` bool, ``[T * topk]`` int64 per layer) and the next forward sets them again. Not for
    a CUDA-graphed step (the graph reads them). Returns the number of attributes dropped."""
    dropped = 0
    for name in dict.fromkeys([*getattr(dispatcher, "cudagraph_attrs", ()), *_FORWARD_STATE]):
        *path, attr = name.split(".")
        holder = dispatcher
        for part in path:
            holder = getattr(holder, part, None)
        value = getattr(holder, attr, None) if holder is not None else None
        if isinstance(value, (torch.Tensor, PermuteMap)):
            setattr(holder, attr, None)
            dropped += 1
    return dropped


class DSv4AlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher; padding tokens (all-False routing rows) are neither permuted nor sent, and
    the token permutation is atomic-free where megatron would run its unfused one (see the module docstring).

    Same constructor and behaviour as ``MoEAlltoAllTokenDispatcher``, plus the per-forward flag
    ``may_have_unrouted_tokens`` (False by default) and the switch ``atomic_free_permute`` (True by default).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.may_have_unrouted_tokens = False
        self.atomic_free_permute = True
        # one TP x EP rank (and on CUDA also with padding tokens): per-expert counts never leave the device (no sync;
        # CUDA-graph safe); see _counts_stay_on_device
        self.keep_counts_on_device = True
        # the current forward's permutation when it took the atomic-free path, else None
        self.permute_map: PermuteMap | None = None

    def release_forward_state(self) -> int:
        """Drop the last forward's routing state (:func:`release_dispatcher_state`); returns the number dropped."""
        return release_dispatcher_state(self)

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        """megatron's preprocess; with unrouted rows the permutation size is the number of routed (token, expert) pairs,
        except where the counts stay on the device (static size ``T·topk`` with filler rows)."""
        # megatron only ever moves the sync point earlier; restart from "no_sync" each call so that a padded batch
        # does not leave the earlier sync behind for later unpadded ones (megatron re-derives its own points here)
        self.cuda_sync_point = "no_sync"
        tokens_per_local_expert = super().preprocess(routing_map)
        if self.may_have_unrouted_tokens and not self.drop_and_pad and not self._counts_stay_on_device():
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

    def _takes_atomic_free_path(self) -> bool:
        """Where megatron runs its unfused argsort ``permute`` / ``scatter_add_`` ``unpermute`` (and the permutation
        size reaches the host before the first permutation, i.e. no CUDA-graphed preprocess)."""
        cfg = self.config
        return (
            self.atomic_free_permute
            and not cfg.moe_permute_fusion
            and not self.drop_and_pad
            and not cfg.moe_router_padding_for_quantization
            and self.cuda_dtoh_point == _FIRST_SYNC_POINT
        )

    def _skips_identity_chunk_sort(self) -> bool:
        """One TP x EP rank: the chunk sort by local expert is the identity (and there is no TP gather/scatter)."""
        return self.permute_map is not None and self.tp_size * self.ep_size == 1

    def _counts_stay_on_device(self) -> bool:
        """One TP x EP rank: nothing needs the per-expert counts on the host (no all-to-all splits, no chunk sort; the
        experts' grouped GEMM takes device counts), so megatron's device-to-host copy and its synchronisation are
        skipped and the layer is sync-free (CUDA-graph capturable). The permutation keeps megatron's static size
        ``T·topk``; with padding tokens (CUDA only) its unrouted tail rows are filler: empty permuted rows that the
        grouped GEMM leaves out and the un-permutation ignores. On CPU, batches with padding keep the exact routed
        count (a host read costs nothing there)."""
        return (
            self.keep_counts_on_device
            and self.tp_size * self.ep_size == 1
            and (not self.may_have_unrouted_tokens or self.routing_map.is_cuda)
            and self._takes_atomic_free_path()
        )

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ):
        """megatron's dispatch preprocess with :func:`hash_moe.permute.permute` as the first permutation."""
        self.permute_map = None
        if not self._takes_atomic_free_path():
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        if probs.dim() != 2 or routing_map.dim() != 2 or routing_map.dtype != torch.bool:
            raise ValueError(
                f"expected probs [T, E] and a bool routing_map [T, E], got {tuple(probs.shape)} and "
                f"{tuple(routing_map.shape)} {routing_map.dtype}"
            )
        # megatron's bookkeeping, in its order: shapes, metadata, shared-expert hook, first sync point
        self.hidden_shape = hidden_states.shape
        self.probs, self.routing_map = probs, routing_map
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])  # [T, H]
        self.tokens_per_expert = self.preprocess(routing_map)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        if not self._counts_stay_on_device():
            self.tokens_per_expert = self._maybe_dtoh_and_synchronize(
                _FIRST_SYNC_POINT, self.tokens_per_expert
            )
        self.hidden_shape_before_permute = hidden_states.shape
        # the permutation size is on the host here: megatron's static T * topk (device counts: with filler rows when
        # tokens are padding) or the routed count synced just above
        x_perm, probs_perm, self.permute_map = permute(
            hidden_states,
            routing_map,
            probs,
            int(self.num_out_tokens),
            max_routes_per_token=self.config.moe_router_topk,
        )  # [R, H], [R]
        self.reversed_local_input_permutation_mapping = self.permute_map.token_of_row
        return x_perm, probs_perm

    def dispatch_postprocess(self, global_input_tokens: torch.Tensor, global_probs: torch.Tensor):
        """megatron's dispatch postprocess, without the identity chunk sort at one TP x EP rank."""
        if not self._skips_identity_chunk_sort():
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        if self._counts_stay_on_device():  # [G] device counts: grouped_mm reads them on the device
            tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
            return global_input_tokens, tokens_per_expert, global_probs
        # megatron's remaining sync points of this stage (no TP all-gather at tp_size 1)
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize(
            "before_permutation_2", self.tokens_per_expert
        )
        tokens_per_expert = self._maybe_dtoh_and_synchronize("before_finish", self.tokens_per_expert)
        self.tokens_per_expert = None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """megatron's combine preprocess, without the identity chunk sort at one TP x EP rank."""
        if not self._skips_identity_chunk_sort():
            return super().combine_preprocess(hidden_states)
        return hidden_states

    def combine_postprocess(self, permutated_local_input_tokens: torch.Tensor) -> torch.Tensor:
        """megatron's combine postprocess with :func:`hash_moe.permute.unpermute` as the last un-permutation."""
        if self.permute_map is None:
            return super().combine_postprocess(permutated_local_input_tokens)
        output = unpermute(permutated_local_input_tokens, self.permute_map, self.hidden_shape_before_permute)
        output = output.view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output
