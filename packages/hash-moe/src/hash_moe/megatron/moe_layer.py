"""The DSv4 MoE layer: megatron-core's ``MoELayer`` with token-id threading and variable-token dispatch (P10).

What it adds to ``MoELayer`` (router, experts and shared expert come from the spec, see
:func:`hash_moe.megatron.get_dsv4_moe_spec`):

1. **Token ids for hash routing.** ``forward(hidden_states, padding_mask=None, input_ids=None, cu_seqlens=None)``:
   ``input_ids [B, S]`` (megatron layout; hidden is ``[S, B, H]``) reach the router for this call only. A caller
   that cannot pass keywords (e.g. megatron's ``TransformerLayer``, which calls ``mlp(h, padding_mask=...)``) sets
   them beforehand with :meth:`DSv4MoELayer.set_input_ids`. ``cu_seqlens`` (THD, ``B = 1``) makes the balance loss
   per document instead of per ``[S, B]`` column. Under ``moe`` selective recompute the ids are checkpointed with
   the inputs, so the recomputation routes identically.
2. **Variable token counts per rank.** megatron's all-gather dispatcher needs the same token count on every rank
   of the TP x EP group. After routing, the local tokens are padded with zero rows (zero probabilities, all-False
   routing map: never dispatched) up to the group maximum rounded up to ``dispatch_alignment``, and the combined
   output is trimmed back. The all-to-all dispatcher takes uneven counts as they are (no padding).
3. **Padding tokens** (``padding_mask`` ``[B, S]``, True = padding, megatron's convention) get zero routing weight,
   are never dispatched, and are ignored by the balance loss and the expert-load counts. Their output is the
   shared expert's alone. With the all-to-all dispatcher this needs
   :class:`~hash_moe.megatron.token_dispatcher.DSv4AlltoAllTokenDispatcher` (installed here in place of megatron's
   ``MoEAlltoAllTokenDispatcher``), which sizes the permutation by the routed count instead of ``tokens * topk``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from hash_moe.megatron.token_dispatcher import DSv4AlltoAllTokenDispatcher, release_dispatcher_state


class DSv4MoELayer(MoELayer):
    """DeepSeekMoE block of DSv4 (one shared expert, hash or learned routing) on megatron-core's ``MoELayer``.

    Args:
        config, submodules, layer_number, pg_collection, is_mtp_layer, name: as megatron's ``MoELayer``.
        dispatch_alignment: token-count alignment of the padded all-gather dispatch (64, as megatron's HybridEP).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MoESubmodules | None = None,
        layer_number: int | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        is_mtp_layer: bool = False,
        name: str | None = None,
        *,
        dispatch_alignment: int = 64,
    ) -> None:
        if dispatch_alignment < 1:
            raise ValueError(f"dispatch_alignment must be >= 1, got {dispatch_alignment}")
        if config.moe_latent_size:
            raise ValueError("DSv4MoELayer does not support moe_latent_size (latent MoE projections)")
        if config.moe_expert_capacity_factor is not None:
            raise ValueError("DSv4 MoE is dropless; set moe_expert_capacity_factor=None")
        if config.moe_shared_expert_overlap:
            raise ValueError(
                "moe_shared_expert_overlap drives megatron's SharedExpertMLP internals; the clamped shared expert "
                "runs beside the dispatch instead: set moe_shared_expert_overlap=False"
            )
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            pg_collection=pg_collection,
            is_mtp_layer=is_mtp_layer,
            name=name,
        )
        if type(self.token_dispatcher) is MoEAlltoAllTokenDispatcher:
            # padding tokens are never dispatched: the all-to-all must count routed tokens, not tokens * topk
            self.token_dispatcher = DSv4AlltoAllTokenDispatcher(
                self.num_local_experts,
                self.local_expert_indices,
                config=self.config,
                pg_collection=pg_collection,
            )
            if hasattr(self, "_training_token_dispatcher"):  # inference-optimized layers keep both
                self._training_token_dispatcher = self.token_dispatcher
        if self.moe_layer_recompute and (config.fp8 or config.fp4):
            raise ValueError("DSv4MoELayer's moe recompute supports bf16/fp32 only (not fp8/fp4)")
        self.dispatch_alignment = dispatch_alignment
        # recompute is done here (with the token ids among the checkpointed inputs), not by MoELayer.forward
        self._recompute_moe = self.moe_layer_recompute
        self.moe_layer_recompute = False
        self._bound_input_ids: torch.Tensor | None = None
        self._bound_cu_seqlens: torch.Tensor | None = None
        self._unpadded_shape: torch.Size | None = None

    @property
    def is_hash_layer(self) -> bool:
        """True when this layer's router chooses experts by token id."""
        return bool(getattr(self.router, "is_hash_layer", False))

    def set_input_ids(self, input_ids: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None) -> None:
        """Bind ``input_ids [B, S]`` (and THD ``cu_seqlens``) for later forwards that do not pass them (None unbinds)."""
        self._bound_input_ids = input_ids
        self._bound_cu_seqlens = cu_seqlens

    def release_forward_state(self) -> int:
        """Drop what the last forward left behind once its backward is done (between training steps): the bound
        token ids (a full-recompute backward binds them again) and the token dispatchers' routing state
        (:func:`~hash_moe.megatron.token_dispatcher.release_dispatcher_state`, any megatron dispatcher). Returns the number of attributes dropped."""
        dropped = int(self._bound_input_ids is not None) + int(self._bound_cu_seqlens is not None)
        self.set_input_ids(None)
        dispatchers = (self.token_dispatcher, getattr(self, "_training_token_dispatcher", None))
        for dispatcher in {id(d): d for d in dispatchers if d is not None}.values():
            dropped += release_dispatcher_state(dispatcher)
        return dropped

    def _dispatch_token_count(self, num_tokens: int, device: torch.device) -> int:
        dispatcher = self.token_dispatcher
        if (
            not isinstance(dispatcher, MoEAllGatherTokenDispatcher)
            or dispatcher.tp_size * dispatcher.ep_size == 1
        ):
            return num_tokens
        count = torch.tensor([num_tokens], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dispatcher.tp_ep_group)
        align = self.dispatch_alignment
        return -(-int(count.item()) // align) * align

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """Pad the routed tokens to the dispatch count (zero rows, never dispatched), then megatron's preprocess."""
        self._unpadded_shape = hidden_states.shape
        n = probs.shape[0]
        n_pad = self._dispatch_token_count(n, probs.device)
        if n_pad != n:
            hidden_states = F.pad(hidden_states.reshape(n, -1), (0, 0, 0, n_pad - n))  # [N_pad, H]
            probs = F.pad(probs, (0, 0, 0, n_pad - n))
            routing_map = F.pad(routing_map, (0, 0, 0, n_pad - n), value=False)
        return super().preprocess(hidden_states, probs, routing_map)

    def postprocess(self, output: torch.Tensor, shared_expert_output: torch.Tensor | None):
        """Restore the dispatcher's shape, trim the dispatch padding, add the shared expert."""
        output = self.token_dispatcher.combine_postprocess(output)
        shape = self._unpadded_shape
        n = shape[:-1].numel()
        if output.shape[:-1].numel() != n:
            output = output.reshape(-1, shape[-1])[:n]
        output = output.reshape(shape)
        if shared_expert_output is not None:
            output = output + shared_expert_output
        return output

    def _forward_with_ids(
        self, hidden_states, padding_mask, input_ids, cu_seqlens, intermediate_tensors=None
    ):
        self.router.set_routing_inputs(input_ids, cu_seqlens)
        if isinstance(self.token_dispatcher, DSv4AlltoAllTokenDispatcher):
            self.token_dispatcher.may_have_unrouted_tokens = padding_mask is not None
        try:
            return MoELayer.forward(self, hidden_states, intermediate_tensors, padding_mask)
        finally:
            self.router.set_routing_inputs(None, None)

    def forward(
        self,
        hidden_states: torch.Tensor,
        intermediate_tensors=None,
        padding_mask: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ):
        """``[S, B, H]`` -> ``(output [S, B, H], None)``.

        Args:
            hidden_states: ``[S, B, H]`` (THD packs: ``[T, 1, H]``).
            intermediate_tensors: megatron's partial-CUDA-graph hand-over (passed through).
            padding_mask: ``[B, S]`` bool, True = padding token.
            input_ids: ``[B, S]`` token ids (required by hash layers; defaults to :meth:`set_input_ids`'s).
            cu_seqlens: THD document boundaries ``[D + 1]`` of this rank's tokens (``B = 1``).
        """
        if input_ids is None:
            input_ids = self._bound_input_ids
        if cu_seqlens is None:
            cu_seqlens = self._bound_cu_seqlens
        if self.is_hash_layer and input_ids is None:
            raise ValueError(
                "this MoE layer routes by token id: pass input_ids=[B, S] to forward() or call set_input_ids() first"
            )
        if padding_mask is not None and padding_mask.shape != (
            hidden_states.shape[1],
            hidden_states.shape[0],
        ):
            raise ValueError(
                f"padding_mask must be [B, S] = {(hidden_states.shape[1], hidden_states.shape[0])} (True = padding), "
                f"got {tuple(padding_mask.shape)}"
            )
        if self._recompute_moe and self.training and intermediate_tensors is None:
            args = (hidden_states, padding_mask, input_ids, cu_seqlens)
            if torch.cuda.is_available():
                return tensor_parallel.checkpoint(self._forward_with_ids, False, *args)
            # megatron's checkpoint stashes the CUDA RNG state; on CPU use torch's (same reentrant semantics)
            return torch.utils.checkpoint.checkpoint(self._forward_with_ids, *args, use_reentrant=True)
        return self._forward_with_ids(
            hidden_states, padding_mask, input_ids, cu_seqlens, intermediate_tensors
        )


def release_forward_state(model: torch.nn.Module) -> int:
    """:meth:`DSv4MoELayer.release_forward_state` on every DSv4 MoE layer of ``model`` (call between training
    steps, after the backward; not for a CUDA-graphed step). Returns the number of attributes dropped."""
    return sum(m.release_forward_state() for m in model.modules() if isinstance(m, DSv4MoELayer))
