"""The DSv4 stack spec (upstream D4 ``hybrid_dsv4_stack_spec``) and the megatron ``TransformerConfig`` of a model.

``dsv4_stack_spec(config)`` is a *callable* taking the megatron config (as upstream): the stack
(:class:`~hybrid_model.stack.DSv4HybridStack`) with one layer spec per symbol of the pattern, each from its record's
spec builder (:mod:`hybrid_model.mixers`; ``E`` also the hash-routed spec of the first ``num_hash_layers`` MoE
layers). Every layer is wrapped by mHC (:class:`mhc.megatron.HyperConnectionLayer`).

Linear layers come from megatron-core's local provider on CPU and from transformer-engine's when the ``gpu`` extra
is installed and CUDA is present (:func:`select_backend`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.spec_utils import ModuleSpec

from dsv4_attention.megatron import DSv4AttentionConfig
from hybrid_model.config import DSv4ModelConfig
from hybrid_model.latent_attention import set_indexer_loss_scales
from hybrid_model.mixers.moe import hash_moe_layer_spec
from hybrid_model.mixers.registry import records_of, require_symbol_dependencies, require_symbol_device
from hybrid_model.stack import DSv4HybridStack
from hybrid_model.symbols import DSA, MOE
from hybrid_model.tensor_parallel import transformer_config_fields
from mhc import MHCConfig


def select_backend(prefer: str = "auto"):
    """Linear-layer provider: ``"local"``, ``"te"`` or ``"auto"`` (TE when importable and CUDA present)."""
    if prefer not in ("auto", "local", "te"):
        raise ValueError(f"backend must be 'auto', 'local' or 'te', got {prefer!r}")
    if prefer == "local":
        return LocalSpecProvider()
    if prefer == "te" or torch.cuda.is_available():
        try:
            import transformer_engine  # noqa: F401
        except ImportError as e:
            if prefer == "te":
                raise ImportError(
                    "transformer-engine is not installed: install the GPU extra `hybrid-model[gpu]`"
                ) from e
            return LocalSpecProvider()
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider()
    return LocalSpecProvider()


def transformer_config(
    cfg: DSv4ModelConfig,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    bf16: bool = False,
    init_method_std: float = 0.02,
    balance_loss_coeff: float = 1e-4,
    indexer_loss_coeff: float = 1.0,
    dense_attention: bool = False,
    perform_initialization: bool = True,
    recompute=None,
    **overrides: Any,
):
    """The megatron ``DSv4AttentionConfig`` (an ``MLATransformerConfig``) carrying attention + MoE + MTP fields.

    ``tensor_model_parallel_size > 1`` turns on sequence parallelism with it and keeps expert TP at 1
    (:func:`hybrid_model.tensor_parallel.transformer_config_fields`).

    ``num_layers`` is the number of *hybrid* layers of the main pattern (each symbol is one layer, so a DSv4 block
    counts twice), as megatron-core's ``HybridModel`` numbers them. ``recompute``: a
    :class:`dsv4_primitives.recompute.RecomputeConfig` (``dsv4_recompute`` plus megatron's ``recompute_*`` fields).
    """
    p = cfg.parsed_pattern
    kw: dict[str, Any] = dict(
        num_layers=len(p.main),
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.moe_intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank,
        v_head_dim=cfg.head_dim,
        qk_pos_emb_head_dim=cfg.qk_rope_head_dim,
        output_projection_groups=cfg.o_groups,
        output_projection_lora_rank=cfg.o_lora_rank,
        csa_window_size=cfg.sliding_window,
        dsa_indexer_n_heads=cfg.index_n_heads,
        dsa_indexer_head_dim=cfg.index_head_dim,
        dsa_indexer_topk=cfg.index_topk,
        dsa_indexer_loss_coeff=indexer_loss_coeff,
        # spec §5.2: the sparse phase's KL runs over the selected top-k (megatron's default False would score and
        # back-propagate the student over every visible entry, [T, HI, C] through the chunked reference)
        dsa_indexer_use_sparse_loss=True,
        csa_dense_mode=dense_attention,  # the phase the layers start in (DSv4Model.set_step_state switches it)
        rotary_base=cfg.rope_theta,
        csa_compress_rotary_base=cfg.compress_rope_theta,
        csa_compress_rope_type="yarn" if cfg.yarn is not None else "rope",
        layernorm_epsilon=cfg.rms_norm_eps,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=cfg.n_routed_experts,
        moe_router_topk=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_shared_expert_intermediate_size=(cfg.moe_intermediate_size if cfg.n_shared_experts else None),
        moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
        moe_router_score_function=cfg.scoring_func,
        moe_router_topk_scaling_factor=cfg.routed_scaling_factor,
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-3,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=balance_loss_coeff,
        moe_router_dtype="fp32",
        activation_func_clamp_value=cfg.swiglu_limit,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        mtp_num_layers=cfg.num_nextn_predict_layers or None,
        mtp_loss_scaling_factor=cfg.mtp_loss_weight,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        # the p2p buffers carry the mHC streams [s, b, n·d] (and their gradients), stored in the stream dtype (fp32)
        # whatever params_dtype is: a bf16 buffer would round the residual streams at every stage boundary, which a
        # single-stage run never does (mhc.megatron.pipeline; megatron's fp32_residual_connection does the same)
        pipeline_dtype=mhc_config(cfg).stream_dtype,
        params_dtype=params_dtype,
        bf16=bf16,
        init_method_std=init_method_std,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=perform_initialization,
        batch_p2p_comm=False,
        variable_seq_lengths=False,
        # DSv4Model.compute_language_model_loss: True = dsv4-primitives' fused vocab-parallel cross entropy (one
        # read of the logits, no fp32 [s, b, V] copies); False = megatron's unfused fp32 path
        cross_entropy_loss_fusion=True,
    )
    if DSA in p.all_symbols:  # megatron's DSA indexers (D) take the same per-micro-batch loss scale
        kw["experimental_attention_variant_loss_scale_func"] = set_indexer_loss_scales
    if recompute is not None and recompute.granularity is not None:
        kw.update(recompute.megatron_fields(), dsv4_recompute=recompute)
    if cfg.yarn is not None:
        kw.update(
            rotary_scaling_factor=cfg.yarn.factor,
            original_max_position_embeddings=cfg.yarn.original_max_position_embeddings,
            beta_fast=cfg.yarn.beta_fast,
            beta_slow=cfg.yarn.beta_slow,
        )
    kw.update(transformer_config_fields(tensor_model_parallel_size, overrides))
    kw.update(
        {k: v for k, v in overrides.items() if k not in ("sequence_parallel", "expert_tensor_parallel_size")}
    )
    return DSv4AttentionConfig(**kw)


def mhc_config(cfg: DSv4ModelConfig, stream_dtype: torch.dtype = torch.float32):
    """The :class:`mhc.MHCConfig` of every mHC instance of the model (with mHC off: the one plain residual stream,
    whose ``stream_dtype`` the stack and the pipeline buffers keep)."""
    return MHCConfig(
        hidden_size=cfg.hidden_size,
        num_streams=cfg.num_streams,  # 1 with mHC off: the plain residual stream
        sinkhorn_iters=cfg.hc_sinkhorn_iters,
        norm_eps=cfg.rms_norm_eps,
        hc_eps=cfg.hc_eps,
        stream_dtype=stream_dtype,
    )


@dataclass
class DSv4StackSubmodules:
    """Layer specs of a DSv4 stack: one per layer symbol of the pattern (``E``: the learned router's) and the
    hash-routed ``E`` spec (``None`` without hash layers, and in MTP depths)."""

    layers: dict = dataclasses.field(default_factory=dict)
    hash_moe_layer: Any = None

    def layer_spec(self, symbol: str, *, hashed: bool = False):
        """The layer spec of ``symbol`` (``hashed``: the hash-routed ``E`` layer's)."""
        if hashed and symbol == MOE:
            if self.hash_moe_layer is None:
                raise ValueError(
                    "the stack spec has no hash-routed MoE layer (num_hash_layers = 0, or an MTP depth)"
                )
            return self.hash_moe_layer
        if symbol not in self.layers:
            raise ValueError(
                f"the stack spec has no layer for symbol {symbol!r} (it is not in the model's pattern)"
            )
        return self.layers[symbol]


def dsv4_stack_submodules(cfg: DSv4ModelConfig, backend=None, *, is_mtp: bool = False) -> DSv4StackSubmodules:
    """The spec of every layer symbol of the pattern (its record's spec builder) and, outside MTP, the hash-routed
    ``E`` layer's. Raises ``ImportError`` naming the missing package when a symbol of the pattern needs one (and a
    ``ValueError`` for a symbol that needs CUDA on a machine without)."""
    symbols = cfg.parsed_pattern.all_symbols
    require_symbol_dependencies(symbols)
    require_symbol_device(symbols)
    backend = backend if backend is not None else select_backend()
    hash_spec = hash_moe_layer_spec(cfg) if not is_mtp and cfg.num_hash_layers else None
    return DSv4StackSubmodules(
        layers={r.symbol: r.spec(cfg, backend, is_mtp) for r in records_of(symbols)},
        hash_moe_layer=hash_spec,
    )


def dsv4_stack_spec(model_config: DSv4ModelConfig, backend=None):
    """``dsv4_stack_spec(cfg)(transformer_config) -> ModuleSpec`` of :class:`~hybrid_model.stack.DSv4HybridStack`.

    Callable in the transformer config like upstream ``hybrid_dsv4_stack_spec``; the returned spec is what
    ``HybridModel(hybrid_stack_spec=...)`` builds the decoder from.
    """

    def build(config) -> ModuleSpec:
        return ModuleSpec(
            module=DSv4HybridStack,
            params={
                "model_config": model_config,
                "mhc": mhc_config(model_config),
                "return_streams": bool(model_config.num_nextn_predict_layers),
            },
            submodules=dsv4_stack_submodules(model_config, backend),
        )

    return build


def replace_submodules(spec, **changes):
    """A copy of a stack ``ModuleSpec`` with some layer specs replaced (``dataclasses.replace`` on submodules)."""
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **changes))
