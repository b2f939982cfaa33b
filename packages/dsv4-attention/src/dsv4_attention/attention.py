"""``DSv4HybridAttention``: the DSv4 self-attention layer for megatron-core (spec §2, upstream D2 + D6).

Input ``x`` = the block input after ``attn_norm`` (``[s, b, d]`` SBHD or ``[t, 1, d]`` THD), rows flattened to
``[T, d]`` in document order (see :mod:`dsv4_attention.layout`):

    cQ = q_layernorm(linear_q_down_proj(x))                        # [T, d_c]   query latent (shared with the indexer)
    q  = linear_q_up_proj(cQ).view(T, n_h, c)                      # [T, n_h, c]
    q  = RoPE(q / sqrt(mean(q^2) + eps), pos)                      # weightless per-head RMSNorm, RoPE on last r dims
    kv = RoPE(kv_layernorm(linear_kv_proj(x)), pos)                # [T, c]     one shared head: K = V
    o  = core_attention(q, kv, x, cQ)                              # [T, n_h, c] window (+ compressed) + sink
    o  = RoPE(o, -pos)                                             # inverse rotation at the query position
    u  = linear_o_group_proj(o.view(T, n_h*c))                     # [T, g*d_g] block-diagonal wo_a
    y  = linear_proj(u)                                            # [T, d]     row-parallel wo_b

Positions restart per document (THD) / per sequence (SBHD). Per-layer RoPE: ``rotary_base`` plain for ratio 0,
``csa_compress_rotary_base`` + YaRN (no mscale) for ratios 4 and 128.

It is a drop-in ``self_attention`` submodule of megatron's ``TransformerLayer`` (0.19.2): constructor keywords
``config, layer_number, pg_collection[, pp_layer_offset, cp_comm_type, name]`` from the layer, ``compress_ratio`` /
``is_mtp_layer`` from the spec params; ``forward`` accepts the layer's keyword arguments and returns ``(y, None)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from dsv4_attention._linears import column_parallel_kwargs
from dsv4_attention._rope import rope
from dsv4_attention.config import LAYER_KINDS, DSv4AttentionConfig, check_compress_ratio
from dsv4_attention.indexer_loss import (
    attach_indexer_loss,
    get_indexer_loss_tracker,
    indexer_loss_tracker_slot,
)
from dsv4_attention.layout import TokenLayout, token_layout
from dsv4_primitives import rms_norm


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


class DSv4HybridAttention(MegatronModule):
    """DSv4 self-attention (window-only / CSA / HCA by ``compress_ratio``) for SBHD and packed THD.

    Args:
        config: :class:`~dsv4_attention.config.DSv4AttentionConfig`.
        submodules: :class:`DSv4HybridAttentionSubmodules` (see :func:`~dsv4_attention.specs.get_dsv4_attention_spec`).
        layer_number: 1-based layer number (within the MTP depth for MTP layers, as megatron numbers them).
        attn_mask_type: must be causal (accepted for megatron compatibility).
        compress_ratio: 0, 4 or 128; ``None`` -> ``config.compress_ratio_for_layer(layer_number, is_mtp_layer)``.
        is_mtp_layer: MTP layer (ratio lookup after the main layers, own indexer-loss tracker slot).
        pg_collection: explicit ``ProcessGroupCollection`` (required).
    """

    def __init__(
        self,
        config: DSv4AttentionConfig,
        submodules: DSv4HybridAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        *,
        compress_ratio: int | None = None,
        is_mtp_layer: bool = False,
        pg_collection=None,
        pp_layer_offset: int | None = None,
        cp_comm_type: str | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(config=config)
        if not isinstance(config, DSv4AttentionConfig):
            raise ValueError(
                f"DSv4HybridAttention needs a DSv4AttentionConfig (or subclass), got {type(config).__name__}"
            )
        if pg_collection is None:
            raise ValueError(
                "DSv4HybridAttention needs an explicit ProcessGroupCollection: pass pg_collection= "
                "(TransformerLayer forwards its own)"
            )
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"DSv4 attention is causal; attn_mask_type={attn_mask_type} is not supported")
        tp = getattr(pg_collection, "tp", None)
        if tp is None:
            raise ValueError("pg_collection.tp must be set (the tensor-parallel group of the linear layers)")
        tp_size = tp.size()
        if tp_size > 1:
            raise ValueError(
                f"DSv4 attention supports tensor-parallel size 1 only, pg_collection.tp has {tp_size}"
            )
        cp = getattr(pg_collection, "cp", None)
        if cp is not None and cp.size() > 1:
            raise ValueError(
                "DSv4 attention does not support context parallelism yet (pg_collection.cp size > 1)"
            )
        self.layer_number = layer_number
        self.is_mtp_layer = is_mtp_layer
        self.pg_collection = pg_collection
        if compress_ratio is None:
            compress_ratio = config.compress_ratio_for_layer(layer_number, is_mtp_layer)
        self.compress_ratio = check_compress_ratio(compress_ratio)
        self.rope_cfg = config.rope_config_for_ratio(self.compress_ratio)
        self.num_heads = config.num_attention_heads
        self.head_dim = config.v_head_dim
        self.groups = config.output_projection_groups
        self.eps = config.layernorm_epsilon

        col = column_parallel_kwargs(config, pg_collection.tp)
        self.linear_q_down_proj = build_module(
            submodules.linear_q_down_proj,
            config.hidden_size,
            config.q_lora_rank,
            tp_comm_buffer_name="q_down_proj",
            **col,
        )
        self.q_layernorm = build_module(
            submodules.q_layernorm, config=config, hidden_size=config.q_lora_rank, eps=self.eps
        )
        self.linear_q_up_proj = build_module(
            submodules.linear_q_up_proj,
            config.q_lora_rank,
            self.num_heads * self.head_dim,
            tp_comm_buffer_name="q_up_proj",
            **col,
        )
        self.linear_kv_proj = build_module(
            submodules.linear_kv_proj, config.hidden_size, self.head_dim, tp_comm_buffer_name="kv_proj", **col
        )
        self.kv_layernorm = build_module(
            submodules.kv_layernorm, config=config, hidden_size=self.head_dim, eps=self.eps
        )
        self.core_attention = build_module(
            submodules.core_attention,
            config=config,
            compress_ratio=self.compress_ratio,
            rope_cfg=self.rope_cfg,
            pg_collection=pg_collection,
        )
        self.linear_o_group_proj = build_module(
            submodules.linear_o_group_proj,
            self.num_heads * self.head_dim,
            self.groups,
            config.output_projection_lora_rank,
            config=config,
            init_method=config.init_method,
        )
        self.linear_proj = build_module(
            submodules.linear_proj,
            self.groups * config.output_projection_lora_rank,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="proj",
            tp_group=pg_collection.tp,
        )

    # ------------------------------------------------------------------ identity
    @property
    def layer_kind(self) -> str:
        """``"sliding_window"`` (ratio 0), ``"csa"`` (4) or ``"hca"`` (128)."""
        return LAYER_KINDS[self.compress_ratio]

    @property
    def tracker_slot(self) -> int:
        """0-based indexer-loss tracker slot of this layer (MTP layers after the main layers)."""
        return indexer_loss_tracker_slot(self.layer_number, self.config.num_layers, self.is_mtp_layer)

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
        layout = token_layout(hidden_states, packed_seq_params)
        y = self.forward_tokens(layout.to_tokens(hidden_states), layout)  # [T, d]
        return layout.from_tokens(y), None

    def forward_tokens(self, x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """The layer on packed token rows: ``x [T, d]`` with its :class:`~dsv4_attention.layout.TokenLayout` ->
        ``[T, d]`` (what ``forward`` runs after flattening SBHD / THD activations)."""
        t = x.shape[0]
        pos = layout.rope_positions  # [T]
        max_pos = layout.max_rope_position

        q_lat, _ = self.linear_q_down_proj(x)  # [T, d_c]
        q_lat = self.q_layernorm(q_lat)  # [T, d_c] shared latent
        q, _ = self.linear_q_up_proj(q_lat)  # [T, n_h*c]
        q = rms_norm(q.view(t, self.num_heads, self.head_dim), None, self.eps)  # [T, n_h, c] no weight
        # in place: the norm saved its input, not this output
        q = rope(q, pos, self.rope_cfg, max_position=max_pos, inplace=True)
        kv, _ = self.linear_kv_proj(x)  # [T, c]
        kv = rope(
            self.kv_layernorm(kv), pos, self.rope_cfg, max_position=max_pos, inplace=True
        )  # [T, c]  K = V

        o, loss = self.core_attention(q, kv, x, q_lat, layout)  # [T, n_h, c]
        if loss is not None:
            o = attach_indexer_loss(o, loss)
            if self.config.dsa_indexer_loss_coeff:
                get_indexer_loss_tracker().save(loss, self.tracker_slot, self.config.tracker_num_layers)
        o = rope(o, pos, self.rope_cfg, inverse=True, max_position=max_pos)  # de-rotate at the query position
        u, _ = self.linear_o_group_proj(o.reshape(t, self.num_heads * self.head_dim))  # [T, g*d_g]
        y, _ = self.linear_proj(u)  # [T, d] (no bias)
        return y

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
