"""What megatron's MLA (``+``) and DSA (``D``) layers share: their sizes, parameters, projection FLOPs, spec choice
and refusals (the layers and their local specs: :mod:`hybrid_model.latent_attention`).

``d`` hidden, ``c`` head dim, ``r`` RoPE dims, ``n_h`` heads, ``d_c`` q rank, ``L = c - r`` megatron's kv rank::

    parameters  d_c·d + n_h·c·d_c + c·d + n_h·(2c - r)·L + d·n_h·c (q down/up, kv down/up, output)
                + d_c + L (q / kv latent norms) + d (input norm)
    FLOPs       2·(d·d_c + d_c·n_h·c + d·c + L·n_h·(2c - r) + n_h·c·d) per token
"""

from __future__ import annotations

from collections.abc import Callable

from hybrid_model.config import DSv4ModelConfig
from hybrid_model.latent_attention import local_latent_layer_spec, te_latent_layer_spec
from hybrid_model.mixers.record import (
    HOST_BOUNDARIES,
    TP_REASON,
    LayerParams,
    Layout,
    Pairs,
    Refusal,
    SymbolRecord,
    is_local,
)

#: the local path's refusals (megatron's TE specs refuse nothing here)
LATENT_REFUSALS = (
    Refusal(
        Layout.CP,
        "without transformer-engine does not support context parallelism (megatron's MLA context parallelism "
        "runs in TE's attention): use CP=1 or C/H/W layers",
        condition="the local spec (without transformer-engine)",
    ),
    Refusal(Layout.TP, TP_REASON, condition="the local spec (without transformer-engine)"),
    HOST_BOUNDARIES,
)


def latent_dims(cfg: DSv4ModelConfig) -> tuple[int, int, int, int, int, int]:
    """``(d, c, r, nh, dc, rank)`` of a ``+``/``D`` layer: hidden, head dim, RoPE dims, heads, q LoRA rank and
    megatron's ``kv_lora_rank = c - r`` (= qk_head_dim, :class:`dsv4_attention.megatron.DSv4AttentionConfig`)."""
    d, c, r = cfg.hidden_size, cfg.head_dim, cfg.qk_rope_head_dim
    return d, c, r, cfg.num_attention_heads, cfg.q_lora_rank, c - r


def latent_params(cfg: DSv4ModelConfig) -> dict[str, int]:
    """The projections and latent norms of a ``+``/``D`` layer (module doc)."""
    d, c, r, nh, dc, rank = latent_dims(cfg)
    return {
        "attention.projections": dc * d + nh * c * dc + c * d + nh * (2 * c - r) * rank + d * nh * c,
        "attention.latent_norms": dc + rank,
    }


def latent_projection_flops(cfg: DSv4ModelConfig) -> int:
    """``+``/``D``: q down/up, kv down/up (or DSA's absorbed equivalents) and output projection, per token."""
    d, c, r, nh, dc, rank = latent_dims(cfg)
    return 2 * (d * dc + dc * nh * c + d * c + rank * nh * (2 * c - r) + nh * c * d)


def latent_spec(record: SymbolRecord, backend):
    """``record``'s layer spec: the local one (:func:`hybrid_model.latent_attention.local_latent_layer_spec`) for
    megatron's ``LocalSpecProvider`` (or no backend and no transformer-engine), else megatron's TE spec."""
    return local_latent_layer_spec(record) if is_local(backend) else te_latent_layer_spec(record)


def latent_record(
    symbol: str,
    layer: str,
    *,
    params: Callable[[DSv4ModelConfig, bool], LayerParams],
    flops: Callable[[DSv4ModelConfig], dict[str, int]],
    core_flops: Callable[[DSv4ModelConfig, Pairs], dict[str, float]],
    core_pass: int,
) -> SymbolRecord:
    """The record of ``+`` or ``D``: :func:`latent_spec`, megatron's layer keywords (the MTP flag and the pipeline
    offset), the local path's refusals and the symbol's counts."""
    record = SymbolRecord(
        symbol=symbol,
        layer=layer,
        spec=lambda cfg, backend, is_mtp: latent_spec(record, backend),
        build_keywords=frozenset({"is_mtp_layer", "pp_layer_offset", "add_layer_offset"}),
        refusals=LATENT_REFUSALS,
        params=params,
        flops=flops,
        core_flops=core_flops,
        core_pass=core_pass,
    )
    return record
