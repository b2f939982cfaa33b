"""``DSv4HybridAttention``: the megatron ``self_attention`` adapter of :class:`~dsv4_attention.attention.DSv4Attention`.

It is a drop-in ``self_attention`` submodule of megatron's ``TransformerLayer`` (0.19.2): constructor keywords
``config, layer_number, pg_collection[, pp_layer_offset, cp_comm_type, name]`` from the layer, ``compress_ratio``
(or ``kind``) / ``is_mtp_layer`` from the spec params; ``forward`` accepts the layer's keyword arguments, flattens
SBHD ``[s, b, d]`` / THD ``[t, 1, d]`` activations into token rows (:mod:`dsv4_attention.layout`), runs the core
layer and returns ``(y, None)``. Under tensor parallelism (``pg_collection.tp`` of ``P > 1`` ranks, sequence
parallelism on) it holds one TP rank's heads and runs the core on the rank's sequence-parallel rows
(:mod:`dsv4_attention.tp`; README "In the megatron adapter"); with context parallelism as well (TP x CP) on the
rank's rows of its CP chunk's sequence split (``pg_collection.tp_cp``). The adapter owns what is megatron's: the
spec-built linears, the process groups, the layer numbering (kind lookup, indexer-loss tracker slot) and the
training phase it passes to the core (:meth:`DSv4HybridAttention.set_dense_attention`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from dsv4_attention.attention import DSv4Attention
from dsv4_attention.cp.layout import packed_context_parallel_layout
from dsv4_attention.indexer_loss import get_indexer_loss_tracker, indexer_loss_tracker_slot
from dsv4_attention.kind import LayerKind
from dsv4_attention.layout import token_layout
from dsv4_attention.megatron._linears import linear_for, tp_size_of
from dsv4_attention.megatron.config import DSv4AttentionConfig
from dsv4_attention.megatron.sharded import tp_sharded_state_dict
from dsv4_attention.tp.layout import tensor_context_parallel_layout, tensor_parallel_layout
from dsv4_primitives.recompute import recompute_config_of

_TPCP_CACHE: dict[tuple[int, int, int], tuple] = {}  # TP x CP layouts of the recent global packs


@dataclass
class DSv4HybridAttentionSubmodules:
    """Submodules of :class:`DSv4HybridAttention` (linears from a backend provider, RMSNorms, core attention)."""

    linear_q_down_proj: Any = None
    q_layernorm: Any = None
    linear_q_up_proj: Any = None
    linear_kv_proj: Any = None
    kv_layernorm: Any = None
    core_attention: Any = None
    linear_o_group_proj: Any = None
    linear_proj: Any = None


class DSv4HybridAttention(DSv4Attention, MegatronModule):
    """DSv4 self-attention (window-only / CSA / HCA) for SBHD and packed THD, built from a megatron spec.

    Args:
        config: :class:`~dsv4_attention.megatron.config.DSv4AttentionConfig`.
        submodules: :class:`DSv4HybridAttentionSubmodules` (see :func:`~dsv4_attention.megatron.specs.get_dsv4_attention_spec`).
        layer_number: 1-based layer number (within the MTP depth for MTP layers, as megatron numbers them).
        attn_mask_type: must be causal (accepted for megatron compatibility).
        kind / compress_ratio: the layer kind (a :class:`LayerKind` or its ratio 0 / 4 / 128); neither ->
            ``config.layer_kind(layer_number, is_mtp_layer)``.
        is_mtp_layer: MTP layer (kind lookup after the main layers, own indexer-loss tracker slot).
        pg_collection: explicit ``ProcessGroupCollection`` (required).
    """

    #: ``(layer, hidden_states [t, 1, d]) -> [t, 1, d]``: replaces this layer's attention while a cached prefill /
    #: decode step runs (bound by :func:`dsv4_attention.decode.bind_decode_step`); ``None``: the training forward
    decode_step = None

    def __init__(
        self,
        config: DSv4AttentionConfig,
        submodules: DSv4HybridAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        *,
        kind: LayerKind | None = None,
        compress_ratio: int | None = None,
        is_mtp_layer: bool = False,
        pg_collection=None,
        pp_layer_offset: int | None = None,
        cp_comm_type: str | None = None,
        name: str | None = None,
    ) -> None:
        MegatronModule.__init__(self, config)
        if not isinstance(config, DSv4AttentionConfig):
            raise ValueError(
                f"DSv4HybridAttention needs a DSv4AttentionConfig (or subclass), got {type(config).__name__}"
            )
        self._check_groups(pg_collection)
        cp = getattr(pg_collection, "cp", None)
        if cp is not None and cp.size() > 1 and cp_comm_type is not None:
            raise ValueError(
                f"cp_comm_type={cp_comm_type!r}: DSv4 attention runs its own static contiguous context parallelism "
                "(dsv4_attention.cp); leave TransformerConfig.cp_comm_type=None"
            )
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"DSv4 attention is causal; attn_mask_type={attn_mask_type} is not supported")
        self.layer_number = layer_number
        self.is_mtp_layer = is_mtp_layer
        self.pg_collection = pg_collection
        self.tp_group = (
            pg_collection.tp
        )  # megatron's sharded_state_dict: the replica ids of the replicated params
        if kind is None:
            kind = (
                config.layer_kind(layer_number, is_mtp_layer)
                if compress_ratio is None
                else LayerKind.from_ratio(compress_ratio)
            )
        elif compress_ratio is not None and LayerKind.from_ratio(compress_ratio) is not kind:
            raise ValueError(f"kind={kind.name} disagrees with compress_ratio={compress_ratio}")
        tp = tp_size_of(pg_collection)
        cfg = config.attention_config(LayerKind.coerce(kind), tp)  # one TP rank's shard (all of it at TP = 1)
        self.dense_attention = bool(config.csa_dense_mode)
        d, dc, n_h, c = config.hidden_size, config.q_lora_rank, cfg.local_heads, cfg.head_dim
        g, dg, eps = cfg.local_groups, cfg.o_lora_rank, cfg.eps
        pg = pg_collection
        # built in checkpoint order (parameter initialisation draws from the RNG in this order). Under TP every
        # linear is a plain one of this rank's size (linear_for): the core gathers the latents and reduce-scatters
        # the output itself, q_up / wo_a / wo_b hold this rank's heads and groups, the rest is replicated
        q_down = linear_for(submodules.linear_q_down_proj, config, pg, d, dc, name="q_down_proj")
        q_norm = build_module(submodules.q_layernorm, config=config, hidden_size=dc, eps=eps)
        q_up = linear_for(submodules.linear_q_up_proj, config, pg, dc, n_h * c, name="q_up_proj")
        kv_proj = linear_for(submodules.linear_kv_proj, config, pg, d, c, name="kv_proj")
        kv_norm = build_module(submodules.kv_layernorm, config=config, hidden_size=c, eps=eps)
        core = build_module(
            submodules.core_attention,
            config=config,
            kind=cfg.kind,
            rope_cfg=cfg.rope,
            pg_collection=pg_collection,
        )
        o_group_proj = build_module(
            submodules.linear_o_group_proj, n_h * c, g, dg, config=config, init_method=config.init_method
        )
        if tp > 1:
            proj = linear_for(
                submodules.linear_proj,
                config,
                pg,
                g * dg,
                d,
                name="proj",
                init_method=config.output_layer_init_method,
            )
        else:
            proj = build_module(
                submodules.linear_proj,
                g * dg,
                d,
                config=config,
                init_method=config.output_layer_init_method,
                bias=False,
                input_is_parallel=True,
                skip_bias_add=True,
                is_expert=False,
                tp_comm_buffer_name="proj",
                tp_group=pg_collection.tp,
            )
        self._init_attention(cfg, q_down, q_norm, q_up, kv_proj, kv_norm, core, o_group_proj, proj)
        self.set_recompute(recompute_config_of(config))  # selective recompute (config.dsv4_recompute)

    @staticmethod
    def _check_groups(pg_collection) -> None:
        if pg_collection is None:
            raise ValueError(
                "DSv4HybridAttention needs an explicit ProcessGroupCollection: pass pg_collection= "
                "(TransformerLayer forwards its own)"
            )
        tp = getattr(pg_collection, "tp", None)
        if tp is None:
            raise ValueError("pg_collection.tp must be set (the tensor-parallel group of the linear layers)")
        cp = getattr(pg_collection, "cp", None)
        if tp.size() > 1 and cp is not None and cp.size() > 1:
            DSv4HybridAttention._check_tensor_context_groups(pg_collection)

    @staticmethod
    def _check_tensor_context_groups(pg_collection) -> None:
        """TP x CP reads megatron's tensor-and-context-parallel group (the sequence half runs over it)."""
        tp, cp = pg_collection.tp, pg_collection.cp
        tp_cp = getattr(pg_collection, "tp_cp", None)
        if tp_cp is None or tp_cp.size() != tp.size() * cp.size():
            raise ValueError(
                f"DSv4 attention under TP {tp.size()} x CP {cp.size()} needs pg_collection.tp_cp (megatron's "
                f"tensor-and-context-parallel group of {tp.size() * cp.size()} ranks), got "
                f"{None if tp_cp is None else tp_cp.size()}: build the collection with "
                "ProcessGroupCollection.use_mpu_process_groups() or set its tp_cp"
            )

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """megatron's sharded state dict with the head-split parameters as TP shards of the TP=1 tensors
        (:func:`~dsv4_attention.megatron.sharded.tp_sharded_state_dict`): a TP checkpoint holds every rank's heads."""
        return tp_sharded_state_dict(self, self.pg_collection.tp, prefix, sharded_offsets, metadata)

    # ------------------------------------------------------------------ identity and phase
    @property
    def tracker_slot(self) -> int:
        """0-based indexer-loss tracker slot of this layer (MTP layers after the main layers)."""
        return indexer_loss_tracker_slot(self.layer_number, self.config.num_layers, self.is_mtp_layer)

    def set_dense_attention(self, dense: bool) -> None:
        """Training phase of the following forwards: dense (CSA attends every visible entry) or sparse (top-k)."""
        self.dense_attention = bool(dense)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_value_states: torch.Tensor | None = None,
        inference_context: Any = None,
        rotary_pos_emb: Any = None,
        rotary_pos_cos: Any = None,
        rotary_pos_sin: Any = None,
        rotary_pos_cos_sin: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
        sequence_len_offset: Any = None,
        *,
        inference_params: Any = None,
    ) -> tuple[torch.Tensor, None]:
        """``hidden_states [s, b, d]`` (SBHD) or ``[t, 1, d]`` + THD ``packed_seq_params`` -> ``(out, None)``."""
        self._reject_unsupported(
            attention_mask,
            key_value_states,
            inference_context if inference_context is not None else inference_params,
            (rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin),
            attention_bias,
            sequence_len_offset,
        )
        if self.decode_step is not None:  # cached prefill / decode step (dsv4_attention.decode)
            return self.decode_step(self, hidden_states), None
        coeff = self.config.dsa_indexer_loss_coeff
        cp = getattr(self.pg_collection, "cp", None)
        tp = self.pg_collection.tp
        tp_cp = tp.size() > 1 and cp is not None and cp.size() > 1
        if tp_cp:  # TP x CP: this rank's rows [L, 1, d] of the global THD pack
            layout = self._tensor_context_parallel_layout(hidden_states, packed_seq_params)
            x = hidden_states.reshape(hidden_states.shape[0], hidden_states.shape[2])  # [L, d]
            from_tokens = lambda y: y.unsqueeze(1)
            partial_group = self.pg_collection.tp_cp  # the indexer loss is this rank's partial over TP x CP
        elif tp.size() > 1:  # TP + SP: this rank's sequence rows [L, b, d] of the global [L*tp, b, d]
            layout = self._tensor_parallel_layout(hidden_states, packed_seq_params, tp)
            x = hidden_states.reshape(hidden_states.shape[0], hidden_states.shape[2])  # [L, d]
            from_tokens = lambda y: y.unsqueeze(1)
            partial_group = tp  # the indexer loss is this TP rank's partial
        elif cp is not None and cp.size() > 1:  # static contiguous CP: local rows, global PackedSeqParams
            layout = packed_context_parallel_layout(hidden_states, packed_seq_params, cp)
            x = hidden_states.reshape(hidden_states.shape[0], hidden_states.shape[2])  # [L, d]
            from_tokens = lambda y: y.unsqueeze(1)
            partial_group = cp  # the indexer loss is this CP rank's partial
        else:
            partial_group = None
            layout = token_layout(hidden_states, packed_seq_params)
            x, from_tokens = layout.to_tokens(hidden_states), layout.from_tokens  # [T, d]
        y, loss = DSv4Attention.forward(
            self, x, layout, dense=self.dense_attention, indexer_loss_coeff=coeff or 0.0
        )  # [T, d] (under CP [L, d])
        if loss is not None and coeff:  # under CP / TP a partial: the tracker sums it over that group
            tracker = get_indexer_loss_tracker()
            tracker.save(loss, self.tracker_slot, self.config.tracker_num_layers, reduce_group=partial_group)
        return from_tokens(y), None

    @staticmethod
    def _tensor_parallel_layout(hidden_states, packed_seq_params, tp_group):
        """This TP rank's :class:`~dsv4_attention.tp.TensorParallelLayout` of its sequence-parallel rows
        ``[L, b, d]``: the global layout is the one of ``[L * tp, b, d]`` (SBHD ``b = 1`` or a THD pack)."""
        rows, b, _ = hidden_states.shape
        if b != 1:
            raise ValueError(
                f"DSv4 attention under tensor parallelism takes micro-batches of one sequence (SBHD b = 1) or a THD "
                f"pack; got hidden_states of shape {tuple(hidden_states.shape)}: use micro-batches of one sequence"
            )
        shape_only = hidden_states.new_empty((rows * tp_group.size(), b, 0))  # the global shape, no data
        return tensor_parallel_layout(token_layout(shape_only, packed_seq_params), tp_group)

    def _tensor_context_parallel_layout(self, hidden_states, packed_seq_params):
        """This rank's TP x CP :class:`~dsv4_attention.tp.TensorParallelLayout`: ``hidden_states [L, 1, d]`` =
        rank ``(c, t)``'s rows ``[(c*TP + t)*L, (c*TP + t + 1)*L)`` of the GLOBAL THD pack ``packed_seq_params``
        (megatron's CP chunk ``c``, cut by sequence parallelism over TP). One layout per global pack and groups
        (every layer of a step shares it and its per-kind plans)."""
        pg = self.pg_collection
        # the THD checks and the global layout of the L * TP * CP rows (cached on the pack)
        seq = packed_context_parallel_layout(hidden_states, packed_seq_params, pg.tp_cp)
        key = (id(seq), id(pg.tp), id(pg.cp))
        hit = _TPCP_CACHE.get(key)
        if hit is not None and hit[0]() is seq:
            return hit[1]
        layout = tensor_context_parallel_layout(seq.global_layout, pg.tp, pg.cp, pg.tp_cp)
        if len(_TPCP_CACHE) >= 2:  # the current and the previous micro-batch
            _TPCP_CACHE.pop(next(iter(_TPCP_CACHE)))
        _TPCP_CACHE[key] = (weakref.ref(seq), layout)
        return layout

    def _reject_unsupported(self, mask, kv_states, inference, rotary, bias, seq_offset) -> None:
        if mask is not None:
            raise ValueError(
                "DSv4 attention builds its own causal/window/document masks; pass attention_mask=None "
                "(explicit attention masks are not supported; use PackedSeqParams for document boundaries)"
            )
        if kv_states is not None:
            raise ValueError("DSv4 attention is self-attention only: key_value_states must be None")
        if inference is not None or seq_offset is not None:
            raise ValueError("DSv4 attention has no KV-cache inference path: inference_context must be None")
        if any(r is not None for r in rotary):
            raise ValueError(
                "DSv4 attention applies its own per-layer RoPE; the model must not pass rotary_pos_emb/cos/sin "
                "(use a multi_latent_attention config so HybridModel/GPTModel build no model-level RoPE)"
            )
        if bias is not None:
            raise ValueError("DSv4 attention does not take an attention_bias")
