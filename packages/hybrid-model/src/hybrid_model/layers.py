"""One hybrid layer per pattern symbol, each wrapped by mHC (the stack and every MTP depth build through here).

======== =============================================================== ==========================================
symbol   inner layer                                                     needs
======== =============================================================== ==========================================
``W``    ``DSv4TransformerLayer`` (window attention)                     --
``C/H``  the same with a CSA / HCA compressor                            --
``E``    ``TransformerLayer`` + DSv4 MoE (hash router on hash positions) --
``-``    ``TransformerLayer``: RMSNorm + megatron ``MLP`` (SwiGLU,        --
         ``ffn_hidden_size = moe_intermediate_size``)
``*``    ``TransformerLayer``: RMSNorm + :class:`~hybrid_model.standard_attention.StandardSelfAttention`
         (own RoPE, causal softmax core, THD aware)                      --
``+``    megatron's MLA layer: TE spec (``hybrid_stack_spec``) or        -- (TE spec: ``transformer_engine``)
         the local spec (:mod:`hybrid_model.latent_attention`)
``D``    megatron's DSA layer (absorbed MLA, ``DSAttention`` + indexer), -- (TE spec: ``transformer_engine``)
         TE or local spec the same way
``G``    megatron's GDN layer: TE spec or the local spec                 ``fla`` (``hybrid-model[gdn]``), CUDA
         (:mod:`hybrid_model.gated_delta_net_layer`)
``M``    megatron's ``MambaLayer`` (``hybrid_stack_spec.mamba_layer``)   ``transformer_engine`` + ``mamba_ssm`` +
                                                                         ``causal_conv1d``
======== =============================================================== ==========================================

``+``/``D`` follow the linear backend (:func:`hybrid_model.spec.select_backend`): megatron-core's TE specs with
transformer-engine's provider, the local specs (same math, :mod:`hybrid_model.latent_attention`) with the local one,
which is what a machine without transformer-engine gets; ``G`` the same way (:mod:`hybrid_model.gated_delta_net_layer`),
its kernels are ``fla``'s (flash-linear-attention, Triton; fla imports on CUDA machines only). ``M`` exists only as
megatron's TE spec; its kernels are mamba-ssm's and causal-conv1d's compiled CUDA kernels (mamba-ssm ships no wheel:
it compiles against the local CUDA toolkit). :func:`require_symbol_dependencies` raises an
``ImportError`` naming what is missing before anything is built. Every layer is a pre-norm sub-layer ``f``; the mHC
wrapper supplies the residual path (``HyperConnectionLayer`` for ``TransformerLayer`` subclasses,
:class:`HyperConnectionMixer` for the Mamba layer; :class:`~hybrid_model.residual.PlainResidualLayer` with mHC off).
"""

from __future__ import annotations

import importlib.util

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from hybrid_model.symbols import ATTENTION, DSA, GDN, MAMBA, MLA, MLP, MOE, attention_kind
from mhc import ManifoldHyperConnection
from mhc.megatron import HyperConnectionLayer

#: symbol -> (python module, pip package / extra) that its layer needs
_TE = ("transformer_engine", "transformer-engine (the `hybrid-model[gpu]` extra; its spec builds the layer)")
SYMBOL_DEPENDENCIES: dict[str, tuple[tuple[str, str], ...]] = {
    GDN: (
        (
            "fla",
            "fla-core (the `hybrid-model[gdn]` extra: flash-linear-attention's gated-delta-rule kernels)",
        ),
    ),
    MAMBA: (
        _TE,
        ("mamba_ssm", "mamba-ssm (`pip install mamba-ssm`: the compiled selective-scan CUDA kernels)"),
        (
            "causal_conv1d",
            "causal-conv1d (`pip install causal-conv1d`: the compiled causal conv1d CUDA kernel)",
        ),
    ),
}
"""symbol -> (python module, pip package / extra) that its layer needs (``+``/``D`` need nothing: without
transformer-engine they build from megatron's local modules)"""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (
        ImportError,
        ValueError,
    ):  # a parent that fails to import, or a module blocked as sys.modules[m] = None
        return False


def require_symbol_dependencies(symbols: str) -> None:
    """Raise ``ImportError`` naming every missing package that the layers of ``symbols`` need."""
    for symbol in sorted(set(symbols) & set(SYMBOL_DEPENDENCIES)):
        missing = [pip for mod, pip in SYMBOL_DEPENDENCIES[symbol] if not _installed(mod)]
        if missing:
            raise ImportError(
                f"pattern symbol '{symbol}' builds megatron-core's {_NAMES[symbol]} layer, which needs "
                f"{' and '.join(missing)} (and a CUDA GPU): install them, or use a pattern without '{symbol}' "
                "('+' MLA and 'D' DSA run without any optional package)"
            )


def require_symbol_device(symbols: str) -> None:
    """``ValueError`` when ``symbols`` holds ``G`` and there is no CUDA GPU: fla, whose kernels the GDN layer runs,
    does not even import without one (checked before megatron's GDN module imports it)."""
    if GDN in symbols and not torch.cuda.is_available():
        raise ValueError(
            "pattern symbol 'G' runs on a CUDA GPU only: megatron's GDN layer runs flash-linear-attention's Triton "
            "kernels, which need one; use a pattern without 'G' here"
        )


def check_single_rank_mixer(config, pg_collection, symbol: str, *, cp_refusal: str) -> None:
    """``ValueError`` for context or tensor parallelism around a megatron-core mixer (``+ D G``) that runs with
    neither inside a DSv4 model; ``cp_refusal`` completes the CP message (why, and what to use instead)."""
    cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if cp is not None and cp.size() > 1:
        raise ValueError(f"pattern symbol '{symbol}' {cp_refusal}")
    if config.tensor_model_parallel_size != 1:
        raise ValueError(
            f"pattern symbol '{symbol}' runs with tensor_model_parallel_size=1 only (DSv4 refuses TP > 1): use --tp 1"
        )


_NAMES = {
    GDN: "GDN (gated delta net; transformer-engine's spec or the local one)",
    MAMBA: "Mamba (megatron has only its transformer-engine spec)",
}


def mlp_layer_spec(backend):
    """``-``: ``TransformerLayer`` with RMSNorm ``pre_mlp_layernorm`` and megatron's dense (SwiGLU) ``MLP``."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.mlp import MLP as MegatronMLP
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from dsv4_primitives import RMSNorm

    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=RMSNorm,
            mlp=ModuleSpec(
                module=MegatronMLP,
                submodules=MLPSubmodules(
                    linear_fc1=backend.column_parallel_linear(), linear_fc2=backend.row_parallel_linear()
                ),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def attention_layer_spec(model_config, backend):
    """``*``: ``TransformerLayer`` with RMSNorm ``input_layernorm`` + :class:`StandardSelfAttention`."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from dsv4_primitives import RMSNorm
    from hybrid_model.standard_attention import CausalSoftmaxAttention, StandardSelfAttention

    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=ModuleSpec(
                module=StandardSelfAttention,
                params={
                    "attn_mask_type": AttnMaskType.causal,
                    "rope_base": model_config.rope_theta,
                    "rotary_percent": model_config.qk_rope_head_dim / model_config.head_dim,
                },
                submodules=SelfAttentionSubmodules(
                    linear_qkv=backend.column_parallel_linear(),
                    core_attention=CausalSoftmaxAttention,
                    linear_proj=backend.row_parallel_linear(),
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
        ),
    )


def megatron_layer_spec(symbol: str, backend=None):
    """``+ D G M``: megatron-core 0.19.2's layer spec of ``symbol``.

    ``+``/``D``/``G``: the local spec (:func:`hybrid_model.latent_attention.local_latent_layer_spec`,
    :func:`hybrid_model.gated_delta_net_layer.local_gdn_layer_spec`) when ``backend`` is megatron's ``LocalSpecProvider``
    (or ``None`` and transformer-engine is not importable), else megatron's TE spec. ``M``: megatron's TE spec. ``G``
    and ``M`` first check their packages (:func:`require_symbol_dependencies`).
    """
    from megatron.core.models.backends import LocalSpecProvider

    from hybrid_model.latent_attention import (
        LATENT_SYMBOLS,
        local_latent_layer_spec,
        te_available,
        te_latent_layer_spec,
    )

    local = isinstance(backend, LocalSpecProvider) if backend is not None else not te_available()
    if symbol in LATENT_SYMBOLS:
        return local_latent_layer_spec(symbol) if local else te_latent_layer_spec(symbol)
    require_symbol_dependencies(symbol)
    if symbol == GDN:
        from hybrid_model.gated_delta_net_layer import local_gdn_layer_spec, te_gdn_layer_spec

        return local_gdn_layer_spec() if local else te_gdn_layer_spec()
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    return hybrid_stack_spec.submodules.mamba_layer


class HyperConnectionMixer(MegatronModule):
    """mHC wrapper of a megatron ``MambaLayer`` (not a ``TransformerLayer``): its ``mamba_bda`` drops the residual,
    so the layer computes ``f(x) = mixer(norm(x))`` and mHC mixes it into the streams (``[s, b, n·d]``)."""

    def __init__(self, config, inner_layer, *, mhc) -> None:
        from hybrid_model.residual import NoResidualBDA

        super().__init__(config=config)
        self.mhc_config = mhc
        self.inner_layer = inner_layer
        self.mixer_hc = ManifoldHyperConnection(mhc)
        inner_layer.mamba_bda = NoResidualBDA()

    @property
    def layer_number(self) -> int:
        return self.inner_layer.layer_number

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **kwargs):
        n, d = self.mhc_config.num_streams, self.mhc_config.hidden_size
        s, b, _ = hidden_states.shape
        streams = hidden_states.view(s, b, n, d)  # [s, b, n, d]
        dtype = torch.bfloat16 if self.config.bf16 else streams.dtype
        x, post, comb = self.mixer_hc(streams, out_dtype=dtype)  # [s, b, d]
        f = self.inner_layer(
            x,
            attention_mask,
            kwargs.get("inference_context"),
            packed_seq_params=kwargs.get("packed_seq_params"),
        )
        return self.mixer_hc.post(f, streams, post, comb).reshape(s, b, n * d), None


def build_hybrid_layer(
    symbol: str,
    submodules,
    config,
    *,
    layer_number: int,
    pg_collection,
    is_mtp_layer: bool,
    pp_layer_offset: int,
    hashed: bool,
    mhc,
    plain_residual: bool = False,
):
    """The mHC-wrapped hybrid layer of one pattern symbol (``submodules``: :class:`~hybrid_model.spec.DSv4StackSubmodules`);
    ``plain_residual``: a :class:`~hybrid_model.residual.PlainResidualLayer` instead (mHC switched off)."""
    from hybrid_model.residual import PlainResidualLayer

    kind = attention_kind(symbol)
    common = dict(config=config, layer_number=layer_number, pg_collection=pg_collection)
    if kind is not None:
        inner = build_module(
            submodules.attention_layer(kind),
            is_mtp_layer=is_mtp_layer,
            add_layer_offset=False,
            pp_layer_offset=pp_layer_offset,
            **common,
        )
    elif symbol == MOE:
        spec = submodules.hash_moe_layer if hashed else submodules.moe_layer
        inner = build_module(spec, is_mtp_layer=is_mtp_layer, add_layer_offset=False, **common)
    elif symbol == MLP:
        inner = build_module(submodules.mlp_layer, add_layer_offset=False, **common)
    elif symbol in (ATTENTION, MLA, DSA):
        spec = submodules.symbol_layer(symbol)
        inner = build_module(
            spec, is_mtp_layer=is_mtp_layer, add_layer_offset=False, pp_layer_offset=pp_layer_offset, **common
        )
    elif symbol == GDN:
        inner = build_module(submodules.symbol_layer(symbol), add_layer_offset=False, **common)
    elif symbol == MAMBA:
        inner = build_module(submodules.symbol_layer(symbol), pp_layer_offset=pp_layer_offset, **common)
        if plain_residual:
            return PlainResidualLayer(config, inner, mixer=True)
        return HyperConnectionMixer(config, inner, mhc=mhc)
    else:
        raise ValueError(f"no layer for pattern symbol {symbol!r} (layer {layer_number})")
    if plain_residual:
        return PlainResidualLayer(config, inner)
    return HyperConnectionLayer(config, inner, mhc=mhc)
