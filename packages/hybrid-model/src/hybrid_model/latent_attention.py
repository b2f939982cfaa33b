"""megatron-core's MLA (``+``) and DSA (``D``) layers without transformer-engine: local layer specs and their config.

megatron-core 0.19.2's ``hybrid_stack_spec`` builds ``+`` and ``D`` from transformer-engine modules. The local specs
here build the same modules (megatron's ``MLASelfAttention``, ``AbsorbedMLASelfAttention``, ``DSAttention`` and
``DSAIndexer``) from megatron's local parts, with the same math:

=====================================  ==========================================  ===============================
TE spec                                local spec                                  same math because
=====================================  ==========================================  ===============================
``TENorm`` input norm                  ``TypedTorchNorm`` (torch ``RMSNorm``)      RMSNorm, ``layernorm_epsilon``
``TELinear`` down projections          ``ColumnParallelLinear``                     TP = 1 (DSv4 refuses TP > 1)
q / kv latent norms fused into         ``TypedTorchNorm`` ``q_layernorm`` /        RMSNorm then a linear
``TELayerNormColumnParallelLinear``    ``kv_layernorm`` + ``ColumnParallelLinear``
(MLA; DSA keeps them standalone)
``TEColumnParallelLinear`` up proj.    ``ColumnParallelLinear``
``TERowParallelLinear`` output         ``RowParallelLinear``
``TEDotProductAttention`` (MLA core)   :class:`~hybrid_model.standard_attention.CausalSoftmaxAttention`
                                       (causal softmax, packed THD per document)
DSA indexer ``TELinear`` (duplicated)  :class:`DuplicatedLinear`                    a full (unsharded) ``x W^T``
DSA indexer ``TENorm`` k-norm          ``TypedTorchNorm`` (torch ``LayerNorm``)    megatron sets LayerNorm
=====================================  ==========================================  ===============================

The layer config (:func:`latent_layer_config`, both paths) is the model's with DeepSeek's latent norms on
(``qk_layernorm``: RMSNorm of the q and kv latents, as DeepSeek-V3 / V3.2) and, for ``D``, megatron's DSA variant.
RoPE / YaRN are megatron's MLA settings of the model config: ``rotary_base = rope_theta``, ``rope_type`` megatron's
default ``"yarn"`` with ``rotary_scaling_factor`` / ``original_max_position_embeddings`` / ``beta_fast`` /
``beta_slow`` from the model's ``yarn`` (DSv4 defaults without it), ``mscale`` / ``mscale_all_dim`` megatron's.
DSA's indexer and KL loss are megatron's (``dsa_indexer_*`` fields, sparse KL, ``dsa_indexer_loss_coeff``); its
Hadamard rotation of the indexer q / k (orthogonal, so ``q·k`` is unchanged; it needs ``fast_hadamard_transform``
and bf16) is used only where it can run.

Packed THD: ``+`` restarts RoPE and attention at every document (``cu_seqlens``); ``D`` uses megatron's packed
DSA masking. Context parallelism is refused for both on the local path (megatron's MLA CP needs TE's attention).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant.absorbed_mla import (
    AbsorbedMLASelfAttention,
    AbsorbedMLASelfAttentionSubmodules,
)
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexer,
    DSAIndexerLossAutoScaler,
    DSAIndexerLossLoggingHelper,
    DSAIndexerSubmodules,
    DSAttention,
    DSAttentionSubmodules,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from dsv4_attention.indexer_loss import IndexerLossAutoScaler
from hybrid_model.mixers.record import Dependency, SymbolRecord
from hybrid_model.standard_attention import CausalSoftmaxAttention
from hybrid_model.symbols import DSA, MLA

LATENT_SYMBOLS = frozenset({MLA, DSA})
#: DSA's Hadamard rotation of the indexer q / k (optional: the scores are the same without it)
FAST_HADAMARD = Dependency("fast_hadamard_transform", "fast-hadamard-transform")


def latent_layer_config(config, symbol: str, *, local: bool):
    """The config of one ``+``/``D`` layer: a shallow copy of the model's with

    * ``qk_layernorm=True`` (RMSNorm of the q latent ``[.., q_lora_rank]`` and the kv latent ``[.., kv_lora_rank]``);
    * ``D``: ``experimental_attention_variant="dsa"`` (megatron keeps DSA's latent norms standalone, the indexer
      reads the normed q latent) and ``dsa_indexer_rotate_activation`` only with ``fast_hadamard_transform`` and
      bf16 (the rotation is orthogonal: indexer scores are unchanged without it);
    * ``local``: ``transformer_impl="local"`` (megatron resolves the latent norms from it).
    """
    if symbol not in LATENT_SYMBOLS:
        raise ValueError(f"latent_layer_config is for the '+' and 'D' symbols, got {symbol!r}")
    out = copy.copy(config)
    out.qk_layernorm = True
    if local:
        out.transformer_impl = "local"
    if symbol == DSA:
        out.experimental_attention_variant = "dsa"
        out.dsa_indexer_rotate_activation = bool(
            config.dsa_indexer_rotate_activation and config.bf16 and FAST_HADAMARD.installed()
        )
    return out


class TypedTorchNorm:
    """megatron's ``WrappedTorchNorm`` (torch ``LayerNorm`` / ``RMSNorm`` as ``config.normalization`` says) with its
    parameters in ``config.params_dtype``, as transformer-engine's ``TENorm`` creates them.

    megatron's wrapper leaves them fp32: a model built with ``params_dtype=torch.bfloat16`` outside megatron's
    ``Float16Module`` then feeds bf16 activations to an fp32 LayerNorm, which CUDA refuses (the DSA indexer's
    k-norm) and RMSNorm runs on its slow mixed-dtype path.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs) -> torch.nn.Module:
        return WrappedTorchNorm(config, hidden_size, eps, **kwargs).to(dtype=config.params_dtype)


class DuplicatedLinear(MegatronModule):
    """``y = x Wᵀ (+ b)`` with the full weight on every rank: the local stand-in of ``TELinear(parallel_mode=
    "duplicated")``, which megatron's DSA indexer builds (``linear_wq_b``, ``linear_wk``, ``linear_weights_proj``).

    Same constructor keywords as megatron's linears; returns ``(output, bias)`` like them (``bias`` is ``None``
    unless ``skip_bias_add``).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method,
        bias: bool,
        skip_bias_add: bool,
        skip_weight_param_allocation: bool = False,
        parallel_mode: str | None = "duplicated",
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group=None,
        name: str | None = None,
    ) -> None:
        super().__init__(config=config)
        if parallel_mode != "duplicated" or skip_weight_param_allocation or is_expert:
            raise ValueError(
                "DuplicatedLinear builds a duplicated (unsharded) weight: parallel_mode='duplicated', "
                "skip_weight_param_allocation=False, is_expert=False"
            )
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, dtype=config.params_dtype, device=device)
        )
        if config.perform_initialization:
            with torch.no_grad():
                init_method(self.weight)
        self.bias = (
            torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype, device=device))
            if bias
            else None
        )
        self.skip_bias_add = skip_bias_add

    def forward(self, x: torch.Tensor):
        if self.skip_bias_add:
            return F.linear(x, self.weight), self.bias
        return F.linear(x, self.weight, self.bias), None


class LatentAttentionLayer:
    """Builder of a ``+``/``D`` ``TransformerLayer`` with its :func:`latent_layer_config` (``module`` of the specs).

    ``LatentAttentionLayer(config, submodules, ..., record=..., local=...)`` returns megatron's ``TransformerLayer``
    built with the layer config; the local path first refuses the context / tensor parallelism that ``record``
    (:mod:`hybrid_model.mixers.mla`, :mod:`hybrid_model.mixers.dsa`) refuses.
    """

    def __new__(cls, config, submodules, *args, record: SymbolRecord, local: bool, **kwargs):
        if local:
            record.check_single_rank(config, kwargs.get("pg_collection"))
        return TransformerLayer(
            latent_layer_config(config, record.symbol, local=local), submodules, *args, **kwargs
        )


def local_latent_layer_spec(record: SymbolRecord):
    """The local (no transformer-engine) ``TransformerLayer`` spec of ``+`` (MLA) or ``D`` (DSA), the symbol of
    ``record``; see module doc."""
    symbol = record.symbol
    if symbol not in LATENT_SYMBOLS:
        raise ValueError(f"local_latent_layer_spec is for the '+' and 'D' symbols, got {symbol!r}")
    linears = dict(
        linear_q_proj=ColumnParallelLinear,
        linear_q_down_proj=ColumnParallelLinear,
        linear_q_up_proj=ColumnParallelLinear,
        linear_kv_down_proj=ColumnParallelLinear,
        linear_kv_up_proj=ColumnParallelLinear,
        linear_proj=RowParallelLinear,
        q_layernorm=TypedTorchNorm,
        kv_layernorm=TypedTorchNorm,
    )
    if symbol == MLA:
        attention = ModuleSpec(
            module=MLASelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=MLASelfAttentionSubmodules(core_attention=CausalSoftmaxAttention, **linears),
        )
    else:
        indexer = ModuleSpec(
            module=DSAIndexer,
            submodules=DSAIndexerSubmodules(
                linear_wq_b=DuplicatedLinear,
                linear_wk=DuplicatedLinear,
                k_norm=TypedTorchNorm,
                linear_weights_proj=DuplicatedLinear,
            ),
        )
        attention = ModuleSpec(
            module=AbsorbedMLASelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=AbsorbedMLASelfAttentionSubmodules(
                core_attention=ModuleSpec(
                    module=DSAttention, submodules=DSAttentionSubmodules(indexer=indexer)
                ),
                **linears,
            ),
        )
    return ModuleSpec(
        module=LatentAttentionLayer,
        params={"record": record, "local": True},
        submodules=TransformerLayerSubmodules(
            input_layernorm=TypedTorchNorm, self_attention=attention, self_attn_bda=get_bias_dropout_add
        ),
    )


def te_latent_layer_spec(record: SymbolRecord):
    """megatron-core's own TE spec of ``+``/``D`` (``hybrid_stack_spec``), built with :func:`latent_layer_config`."""
    # megatron's spec module imports transformer-engine's extension and megatron's GDN, which imports fla where it is
    # installed (optional; fla raises without a GPU): only when a TE spec is asked for
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    subs = hybrid_stack_spec.submodules
    spec = {MLA: subs.mla_layer, DSA: subs.dsa_layer}[record.symbol]
    return dataclasses.replace(spec, module=LatentAttentionLayer, params={"record": record, "local": False})


def set_indexer_loss_scales(scale) -> None:
    """The per-micro-batch indexer-loss backward scale for DSv4's CSA indexers and megatron's DSA indexers (``D``):
    the model config's ``experimental_attention_variant_loss_scale_func`` when the pattern has ``D``."""
    IndexerLossAutoScaler.set_loss_scale(scale)
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor(float(scale))
    cur = DSAIndexerLossAutoScaler.main_loss_backward_scale
    if cur is None or cur.shape != scale.shape or cur.device != scale.device:  # e.g. left by an earlier run
        DSAIndexerLossAutoScaler.main_loss_backward_scale = scale.detach().clone()
    else:
        cur.copy_(scale.detach())


def drain_dsa_indexer_losses() -> torch.Tensor | None:
    """megatron's per-layer DSA indexer losses (coefficient-scaled, one slot per 1-based ``layer_number``) recorded
    since the last call, or ``None``; the tracker is emptied (the next model may have more layers)."""
    values = DSAIndexerLossLoggingHelper.tracker.pop("values", None)
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
    return None if values is None else values.detach()


def reset_dsa_indexer_loss_state() -> None:
    """Forget megatron's DSA indexer-loss backward scale and tracked losses (a new run starts fresh)."""
    DSAIndexerLossAutoScaler.main_loss_backward_scale = None
    DSAIndexerLossLoggingHelper.tracker.clear()
