"""ModuleSpec builders for DSv4 attention (upstream D2 ``get_dsv4_hybrid_module_spec_for_backend`` shape).

``get_dsv4_attention_spec(kind, backend=...)`` (a :class:`~dsv4_attention.kind.LayerKind` or its compress ratio)
returns the spec of one :class:`~dsv4_attention.megatron.attention.DSv4HybridAttention` with every submodule
explicit:

=========================  ==========================================  ===============================
submodule                  module                                      checkpoint tensor (spec §2.1)
=========================  ==========================================  ===============================
``linear_q_down_proj``     ``backend.column_parallel_linear()``        ``attn.wq_a``
``q_layernorm``            ``dsv4_primitives.RMSNorm`` (fp32 math)     ``attn.q_norm``
``linear_q_up_proj``       ``backend.column_parallel_linear()``        ``attn.wq_b``
``linear_kv_proj``         ``backend.column_parallel_linear()``        ``attn.wkv``
``kv_layernorm``           ``RMSNorm``                                 ``attn.kv_norm``
``core_attention``         ``MegatronCompressedSparseAttention``       ``attn.attn_sink`` (+ below)
  ``.compressor``          ``MegatronCompressor`` (CSA / HCA)          ``attn.compressor.{wkv,wgate,ape,norm}``
  ``.indexer``             ``MegatronLightningIndexer`` (CSA)          ``attn.indexer.{wq_b,weights_proj,compressor}``
``linear_o_group_proj``    ``MegatronGroupedOutputProjection``         ``attn.wo_a``
``linear_proj``            ``backend.row_parallel_linear()``           ``attn.wo_b``
=========================  ==========================================  ===============================

``backend``: megatron-core's ``LocalSpecProvider`` (plain torch linears, CPU) or ``TESpecProvider``
(transformer-engine linears); ``None`` picks TE when it is importable and CUDA is available, else local.
:func:`get_dsv4_layer_spec` wraps the attention spec in a megatron ``TransformerLayer`` spec (attention half only);
:class:`DSv4TransformerLayer` threads ``is_mtp_layer`` from the layer into the attention.
"""

from __future__ import annotations

import dataclasses

from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from dsv4_attention.kind import LayerKind
from dsv4_attention.megatron.attention import DSv4HybridAttention, DSv4HybridAttentionSubmodules
from dsv4_attention.megatron.modules import (
    CompressedSparseAttentionSubmodules,
    CompressorSubmodules,
    LightningIndexerSubmodules,
    MegatronCompressedSparseAttention,
    MegatronCompressor,
    MegatronGroupedOutputProjection,
    MegatronLightningIndexer,
)
from dsv4_primitives import RMSNorm

KindOrRatio = LayerKind | int


def default_backend() -> BackendSpecProvider:
    """transformer-engine's provider when TE is importable and CUDA is available, else megatron's local one."""
    import torch

    if torch.cuda.is_available():
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            return LocalSpecProvider()
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider()
    return LocalSpecProvider()


def te_backend() -> BackendSpecProvider:
    """transformer-engine's provider; raises ImportError naming the extra when TE is missing."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "transformer-engine is not installed: install the GPU extra (`hybrid-model[gpu]`) or use "
            "megatron.core.models.backends.LocalSpecProvider()"
        ) from e
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    return TESpecProvider()


def _compressor_spec(backend: BackendSpecProvider, norm) -> ModuleSpec:
    return ModuleSpec(
        module=MegatronCompressor,
        submodules=CompressorSubmodules(
            linear_wkv=backend.column_parallel_linear(),
            linear_wgate=backend.column_parallel_linear(),
            norm=norm,
        ),
    )


def _kind_or_none(kind: KindOrRatio | None) -> LayerKind | None:
    return None if kind is None else LayerKind.coerce(kind)


def get_core_attention_spec(
    kind: KindOrRatio | None, backend: BackendSpecProvider | None = None, norm=RMSNorm
) -> ModuleSpec:
    """Spec of the core attention of one layer kind (compressor / indexer only where the kind has them).

    ``kind=None`` gives the superset spec (compressor and indexer); the module builds only what its kind needs.
    """
    kind = _kind_or_none(kind)
    backend = backend if backend is not None else default_backend()
    compressor = _compressor_spec(backend, norm) if kind is None or kind.has_compressor else None
    indexer = None
    if kind is None or kind.has_indexer:
        indexer = ModuleSpec(
            module=MegatronLightningIndexer,
            submodules=LightningIndexerSubmodules(
                linear_wq_b=backend.column_parallel_linear(),
                linear_weights_proj=backend.column_parallel_linear(),
                compressor=_compressor_spec(backend, norm),
            ),
        )
    return ModuleSpec(
        module=MegatronCompressedSparseAttention,
        submodules=CompressedSparseAttentionSubmodules(compressor=compressor, indexer=indexer),
    )


def get_dsv4_attention_spec(
    kind: KindOrRatio | None,
    backend: BackendSpecProvider | None = None,
    *,
    is_mtp_layer: bool = False,
    norm=RMSNorm,
) -> ModuleSpec:
    """Spec of one :class:`DSv4HybridAttention` of ``kind`` (a :class:`LayerKind`, or its ratio 0 / 4 / 128).

    ``kind=None``: one spec for every layer; each layer reads its kind from
    ``config.csa_compress_ratios[layer_number - 1]`` (MTP layers: ``[num_layers + layer_number - 1]``).
    """
    kind = _kind_or_none(kind)
    backend = backend if backend is not None else default_backend()
    params = {"attn_mask_type": AttnMaskType.causal}
    if kind is not None:
        params["kind"] = kind
    if is_mtp_layer:
        params["is_mtp_layer"] = True
    return ModuleSpec(
        module=DSv4HybridAttention,
        params=params,
        submodules=DSv4HybridAttentionSubmodules(
            linear_q_down_proj=backend.column_parallel_linear(),
            q_layernorm=norm,
            linear_q_up_proj=backend.column_parallel_linear(),
            linear_kv_proj=backend.column_parallel_linear(),
            kv_layernorm=norm,
            core_attention=get_core_attention_spec(kind, backend, norm),
            linear_o_group_proj=MegatronGroupedOutputProjection,
            linear_proj=backend.row_parallel_linear(),
        ),
    )


def window_attention_spec(backend: BackendSpecProvider | None = None, **kw) -> ModuleSpec:
    """Sliding-window-only attention (:attr:`LayerKind.WINDOW`, symbol ``W``)."""
    return get_dsv4_attention_spec(LayerKind.WINDOW, backend, **kw)


def csa_attention_spec(backend: BackendSpecProvider | None = None, **kw) -> ModuleSpec:
    """Compressed sparse attention (:attr:`LayerKind.CSA`: ratio 4 + lightning indexer, symbol ``C``)."""
    return get_dsv4_attention_spec(LayerKind.CSA, backend, **kw)


def hca_attention_spec(backend: BackendSpecProvider | None = None, **kw) -> ModuleSpec:
    """Heavily compressed attention (:attr:`LayerKind.HCA`: ratio 128, symbol ``H``)."""
    return get_dsv4_attention_spec(LayerKind.HCA, backend, **kw)


class DSv4TransformerLayer(TransformerLayer):
    """megatron ``TransformerLayer`` that passes its ``is_mtp_layer`` on to a DSv4 attention submodule.

    megatron-core 0.19.2's ``TransformerLayer`` receives ``is_mtp_layer`` from ``HybridStack`` / MTP but does not
    forward it to ``self_attention``; DSv4 attention needs it for the ratio lookup and the indexer-loss slot.
    """

    def __init__(
        self, config, submodules: TransformerLayerSubmodules, *args, is_mtp_layer: bool = False, **kwargs
    ):
        attn = submodules.self_attention
        if (
            is_mtp_layer
            and isinstance(attn, ModuleSpec)
            and isinstance(attn.module, type)
            and issubclass(attn.module, DSv4HybridAttention)
        ):
            attn = dataclasses.replace(attn, params={**attn.params, "is_mtp_layer": True})
            submodules = dataclasses.replace(submodules, self_attention=attn)
        super().__init__(config, submodules, *args, is_mtp_layer=is_mtp_layer, **kwargs)


def get_dsv4_layer_spec(
    kind: KindOrRatio | None,
    backend: BackendSpecProvider | None = None,
    *,
    is_mtp_layer: bool = False,
    norm=RMSNorm,
) -> ModuleSpec:
    """``DSv4TransformerLayer`` spec: ``input_layernorm`` (RMSNorm) + DSv4 attention + bias-dropout-add.

    This is the attention half of a DSv4 block (HybridModel symbols ``W``/``C``/``H``); the MoE half is a separate
    hybrid layer (``E``). mHC wrapping, if any, is up to the model package.
    """
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    return ModuleSpec(
        module=DSv4TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=get_dsv4_attention_spec(kind, backend, is_mtp_layer=is_mtp_layer, norm=norm),
            self_attn_bda=get_bias_dropout_add,
        ),
    )
