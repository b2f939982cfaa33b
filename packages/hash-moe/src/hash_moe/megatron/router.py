"""megatron-core routers for DSv4: :class:`LearnedTopKRouter` (aux-loss-free bias) and :class:`HashRouter` (P4).

Both implement megatron's ``RouterInterface``: ``forward(hidden [S, B, H], padding_mask [S, B] | None) ->
(probs [S·B, E] fp32, routing_map [S·B, E] bool)`` with megatron's padding convention (``True`` = padding). Gate
logits are computed in fp32 (``router_gating_linear``), whatever the parameter dtype. Padding tokens get zero
probabilities and an all-False routing map (never dispatched) and are ignored by the balance statistics.

Settings read from the ``TransformerConfig`` (megatron names):

| config field | meaning here |
|---|---|
| ``num_moe_experts`` / ``moe_router_topk`` | ``E`` / ``K`` |
| ``moe_router_score_function`` | ``sqrtsoftplus`` / ``sigmoid`` / ``softmax`` |
| ``moe_router_topk_scaling_factor`` | ``routed_scaling_factor`` (None = 1.0) |
| ``moe_router_enable_expert_bias`` / ``moe_router_bias_update_rate`` | count loads for the selection bias / speed γ |
| ``moe_router_load_balancing_type="seq_aux_loss"`` + ``moe_aux_loss_coeff`` | sequence-wise balance loss α |

The selection bias is the buffer ``e_score_correction_bias`` (HF name; official ``gate.bias``), deliberately not
megatron's ``expert_bias``: megatron's ``finalize_model_grads`` would otherwise update it *before* the optimizer
step. Update it *after* the step with :func:`hash_moe.megatron.update_selection_biases`.

Hash routers need the token ids: the MoE layer hands them over through :meth:`set_routing_inputs` (see
:class:`hash_moe.megatron.DSv4MoELayer`).
"""

from __future__ import annotations

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    get_default_pg_collection,
    router_gating_linear,
)
from megatron.core.transformer.moe.router import Router
from megatron.core.transformer.transformer_config import TransformerConfig

from dsv4_primitives import KeepFP32Mixin, mark_keep_in_fp32
from hash_moe.balance import sequence_balance_loss, sequence_ids_from_cu_seqlens, tokens_per_expert
from hash_moe.hash_table import build_tid2eid_round_robin, validate_tid2eid
from hash_moe.routing import RouterConfig, RoutingResult, dense_routing, hash_route, topk_route


def router_config_from_transformer_config(config: TransformerConfig) -> RouterConfig:
    """The :class:`~hash_moe.routing.RouterConfig` described by megatron's MoE config fields."""
    if config.num_moe_experts is None:
        raise ValueError("TransformerConfig.num_moe_experts must be set for an MoE router")
    return RouterConfig(
        num_experts=config.num_moe_experts,
        topk=config.moe_router_topk,
        score_function=config.moe_router_score_function,
        routed_scaling_factor=config.moe_router_topk_scaling_factor or 1.0,
        normalize_topk=True,
    )


def balance_loss_coeff_from_transformer_config(config: TransformerConfig) -> float:
    """α of the sequence-wise balance loss; ValueError if another megatron aux loss is switched on."""
    types = config.moe_router_load_balancing_type
    coeffs = config.moe_aux_loss_coeff
    if isinstance(types, str):
        types, coeffs = [types], [coeffs]
    elif not isinstance(coeffs, (list, tuple)):
        coeffs = [coeffs] * len(types)
    alpha = 0.0
    for kind, coeff in zip(types, coeffs):
        if kind == "seq_aux_loss":
            alpha = float(coeff)
        elif coeff and kind not in ("none",):
            raise ValueError(
                f"DSv4 routers implement only the sequence-wise balance loss; got moe_router_load_balancing_type="
                f"{kind!r} with coefficient {coeff}. Use 'seq_aux_loss' (or a zero coefficient)."
            )
    if z := config.moe_z_loss_coeff:
        raise ValueError(f"DSv4 routers do not implement the z-loss; set moe_z_loss_coeff=None (got {z})")
    return alpha


class _DSv4Router(Router):
    """Shared gate, padding handling, routing-input plumbing and balance loss of the DSv4 routers."""

    is_hash_layer: bool = False
    uses_balance_loss: bool = True

    def __init__(
        self,
        config: TransformerConfig,
        pg_collection: ProcessGroupCollection | None = None,
        is_mtp_layer: bool = False,
    ) -> None:
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        if self.bias is not None:
            raise ValueError("the DSv4 gate has no linear bias; set TransformerConfig.add_bias_linear=False")
        # megatron's Router allocates the gate on the CPU and moves it lazily; allocate it where it is used
        if torch.cuda.is_available():
            self.weight.data = self.weight.data.to(torch.cuda.current_device())
        self.routing_config = router_config_from_transformer_config(config)
        self.balance_loss_coeff = (
            balance_loss_coeff_from_transformer_config(config) if self.uses_balance_loss else 0.0
        )
        self._input_ids: torch.Tensor | None = None
        self._cu_seqlens: torch.Tensor | None = None

    def set_routing_inputs(
        self, input_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None
    ) -> None:
        """Token ids ``[B, S]`` (megatron layout) and THD ``cu_seqlens`` for the next forward calls (None clears).

        Under static contiguous context parallelism (``pg_collection.cp`` of size > 1) and / or tensor parallelism
        with sequence parallelism, the ids are this rank's rows ``[1, L]`` (rank ``r`` of ``pg_collection.tp_cp``
        holding the ``r``-th slice of the pack) and ``cu_seqlens`` the *global* documents clipped to the rank's rows
        (every rank keeps all ``D + 1`` entries, documents without a row here being empty;
        :func:`hybrid_model.mtp.router_cu_seqlens`): the balance loss's per-document counts and lengths are then
        summed over the TP x CP group and each rank returns its partial (:mod:`dsv4_primitives.cp_partial_loss`)."""
        self._input_ids = input_ids
        self._cu_seqlens = cu_seqlens

    def _route(self, logits: torch.Tensor, valid: torch.Tensor | None, s: int, b: int) -> RoutingResult:
        raise NotImplementedError(
            f"{type(self).__name__} must implement _route (learned top-k or hash routing)"
        )

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """megatron's ``Router.routing`` hook: ``[S, B, E]`` logits (+ ``[S, B]`` padding mask) -> (probs, map)."""
        s, b = logits.shape[:2]
        valid = None if padding_mask is None else ~padding_mask.reshape(-1).bool()
        result = self._route(logits.reshape(s * b, -1), valid, s, b)
        probs, routing_map = dense_routing(result, self.routing_config.num_experts)
        probs = self._attach_balance_loss(probs, result, s, b)
        self._after_routing(result)
        return probs, routing_map

    def _sequence_ids(self, n: int, b: int, device: torch.device) -> tuple[torch.Tensor, int, object]:
        if self._cu_seqlens is not None:
            if b != 1:
                raise ValueError(
                    f"cu_seqlens (THD packing) needs batch size 1 in the [S, B, H] input, got B={b}"
                )
            cu = self._cu_seqlens.to(device)
            # per document of the pack; under CP and / or TP (sequence parallelism) the documents are global
            # (clipped to this rank's rows), so their counts and lengths are summed over the TP x CP group
            group = self.tp_cp_group if self.tp_cp_group.size() > 1 else None
            return sequence_ids_from_cu_seqlens(cu, n), cu.numel() - 1, group
        # token i of the flattened [S, B] input belongs to sequence (column) i % B
        return torch.arange(n, device=device) % b, b, self.tp_cp_group

    def _attach_balance_loss(
        self, probs: torch.Tensor, result: RoutingResult, s: int, b: int
    ) -> torch.Tensor:
        if not (
            self.balance_loss_coeff > 0
            and self.uses_balance_loss
            and self.training
            and torch.is_grad_enabled()
        ):
            return probs
        n = probs.shape[0]
        seq_ids, num_seqs, group = self._sequence_ids(n, b, probs.device)
        loss = sequence_balance_loss(
            result.scores,
            result.experts,
            coeff=self.balance_loss_coeff,
            sequence_ids=seq_ids,
            num_sequences=num_seqs,
            valid=result.valid,
            group=group,
        )
        self.last_balance_loss = loss.detach()
        if self.layer_number is not None:
            num_layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
            layer = self.layer_number + (self.config.num_layers if self.is_mtp_layer else 0)
            get_moe_metrics_tracker().record(
                "seq_load_balancing_loss",
                loss.detach() / self.balance_loss_coeff,
                layer,
                num_layers,
                reduce_group=self.tp_cp_group,
            )
        if self.calculate_per_token_loss:
            # same scaling as megatron's aux losses under per-token loss averaging
            valid_tokens = n if result.valid is None else result.valid.sum()
            return MoEAuxLossAutoScaler.apply(probs, loss * valid_tokens * self.tp_cp_group.size())
        return MoEAuxLossAutoScaler.apply(probs, loss)

    def _after_routing(self, result: RoutingResult) -> None:
        """Hook for per-step statistics (learned routers count expert loads)."""

    def forward(self, input: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """``[S, B, H]`` hidden states (+ ``[S, B]`` padding mask, True = padding) -> ``(probs, routing_map)``."""
        if input.dim() != 3:
            raise ValueError(f"router input must be [S, B, H], got {tuple(input.shape)}")
        s, b, _ = input.shape
        if padding_mask is not None and padding_mask.shape != (s, b):
            raise ValueError(
                f"padding_mask must be [S, B] = {(s, b)} inside the router, got {tuple(padding_mask.shape)}"
            )
        # fp32 gate logits (fp64 when the model runs in fp64)
        logits = router_gating_linear(
            input, self.weight, None, torch.promote_types(input.dtype, torch.float32)
        )
        return self.routing(logits, padding_mask)


class LearnedTopKRouter(KeepFP32Mixin, _DSv4Router):
    """Learned top-k router: ``topk(s + e_score_correction_bias)``, weights from the unbiased ``s``.

    Buffers: ``e_score_correction_bias [E]`` fp32 (persistent; kept fp32 under bf16 modules) and
    ``local_tokens_per_expert [E]`` fp32 (loads since the last bias update; counted on grad-enabled forwards
    when ``moe_router_enable_expert_bias`` is set).
    """

    def __init__(
        self,
        config: TransformerConfig,
        pg_collection: ProcessGroupCollection | None = None,
        is_mtp_layer: bool = False,
    ) -> None:
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        e = self.routing_config.num_experts
        device = self.weight.device
        # fp32 under bf16/fp16 modules (KeepFP32Mixin): bias steps of ~1e-3 and token counts past 256 need it
        bias = mark_keep_in_fp32(torch.zeros(e, dtype=torch.float32, device=device))
        self.register_buffer("e_score_correction_bias", bias)
        loads = mark_keep_in_fp32(torch.zeros(e, dtype=torch.float32, device=device))
        self.register_buffer("local_tokens_per_expert", loads, persistent=False)
        self.count_loads = bool(config.moe_router_enable_expert_bias)
        self.bias_update_speed = float(config.moe_router_bias_update_rate)

    def _route(self, logits, valid, s, b):
        return topk_route(
            logits, self.routing_config, selection_bias=self.e_score_correction_bias, valid=valid
        )

    def _after_routing(self, result: RoutingResult) -> None:
        if self.count_loads and torch.is_grad_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert += tokens_per_expert(
                    result.experts, self.routing_config.num_experts, result.valid
                )


class HashRouter(_DSv4Router):
    """Hash router (P4): experts ``tid2eid[token_id]``, weights from this layer's learned gate scores.

    The table is the persistent integer buffer ``tid2eid [V, K]`` (int32; never trained, saved in checkpoints;
    int64 tables from HF/official checkpoints load too). No selection bias and no balance loss (**[OUR CHOICE]**,
    spec §7.5). MTP layers never hash.

    Args:
        config, pg_collection, is_mtp_layer: as megatron's routers.
        vocab_size: ``V``; the (padded) vocabulary the token ids come from.
        tid2eid: initial ``[V, K]`` table (see :mod:`hash_moe.hash_table`); default round-robin (replace it with a
            balanced table or load one from a checkpoint).
    """

    is_hash_layer = True
    uses_balance_loss = False

    def __init__(
        self,
        config: TransformerConfig,
        pg_collection: ProcessGroupCollection | None = None,
        is_mtp_layer: bool = False,
        *,
        vocab_size: int,
        tid2eid: torch.Tensor | None = None,
    ) -> None:
        if is_mtp_layer:
            raise ValueError(
                "MTP layers use learned routing, never hash routing (build them with hash_routing=False)"
            )
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        cfg = self.routing_config
        if tid2eid is None:
            tid2eid = build_tid2eid_round_robin(vocab_size, cfg.num_experts, cfg.topk)
        validate_tid2eid(tid2eid, num_experts=cfg.num_experts, topk=cfg.topk, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        self.register_buffer("tid2eid", tid2eid.to(device=self.weight.device, dtype=torch.int32).contiguous())

    @torch.no_grad()
    def set_tid2eid(self, tid2eid: torch.Tensor) -> None:
        """Replace the table (validated; same ``[V, K]`` shape)."""
        cfg = self.routing_config
        validate_tid2eid(tid2eid, num_experts=cfg.num_experts, topk=cfg.topk, vocab_size=self.vocab_size)
        self.tid2eid.copy_(tid2eid.to(torch.int32))

    def _route(self, logits, valid, s, b):
        ids = self._input_ids
        if ids is None:
            raise ValueError(
                "hash-routed MoE layer called without token ids: pass input_ids=[B, S] to DSv4MoELayer.forward "
                "(or DSv4MoELayer.set_input_ids) before the forward pass"
            )
        if ids.shape != (b, s):
            raise ValueError(
                f"input_ids must be [B, S] = {(b, s)} matching the MoE input [S, B, H] (under sequence parallelism "
                f"pass this rank's sequence shard); got {tuple(ids.shape)}"
            )
        flat = ids.to(logits.device).transpose(0, 1).reshape(-1)  # [S*B] in the [S, B] token order
        return hash_route(logits, flat, self.tid2eid, self.routing_config, valid=valid)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        key = prefix + "tid2eid"
        if key in state_dict:
            cfg = self.routing_config
            validate_tid2eid(
                state_dict[key], num_experts=cfg.num_experts, topk=cfg.topk, vocab_size=self.vocab_size
            )
        return super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
