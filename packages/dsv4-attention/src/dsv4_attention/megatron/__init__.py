"""megatron-core adapter of dsv4-attention (extra ``dsv4-attention[megatron]``).

It builds the core's linears from ``ModuleSpec``s (megatron local or transformer-engine linears), maps the megatron
``TransformerConfig`` (:class:`DSv4AttentionConfig`) to the core's frozen configs, owns the process groups, and
exposes the layer as megatron's ``self_attention`` (:class:`DSv4HybridAttention`) with the layer numbering and the
indexer-loss tracker slots. Every module is a subclass of its plain-PyTorch core module (same parameters, same
state-dict keys, same numerics) and a ``MegatronModule``.
"""

from __future__ import annotations

try:
    import megatron.core  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised in a subprocess by test_public_api
    raise ImportError(
        "dsv4_attention.megatron needs megatron-core: pip install 'dsv4-attention[megatron]' "
        "(the plain-PyTorch core, `import dsv4_attention`, works without it)"
    ) from e

from dsv4_attention.megatron.attention import DSv4HybridAttention, DSv4HybridAttentionSubmodules
from dsv4_attention.megatron.config import DSv4AttentionConfig
from dsv4_attention.megatron.modules import (
    CompressedSparseAttentionSubmodules,
    CompressorSubmodules,
    LightningIndexerSubmodules,
    MegatronCompressedSparseAttention,
    MegatronCompressor,
    MegatronGroupedOutputProjection,
    MegatronLightningIndexer,
)
from dsv4_attention.megatron.specs import (
    DSv4TransformerLayer,
    csa_attention_spec,
    default_backend,
    get_core_attention_spec,
    get_dsv4_attention_spec,
    get_dsv4_layer_spec,
    hca_attention_spec,
    te_backend,
    window_attention_spec,
)

__all__ = [
    "CompressedSparseAttentionSubmodules",
    "CompressorSubmodules",
    "DSv4AttentionConfig",
    "DSv4HybridAttention",
    "DSv4HybridAttentionSubmodules",
    "DSv4TransformerLayer",
    "LightningIndexerSubmodules",
    "MegatronCompressedSparseAttention",
    "MegatronCompressor",
    "MegatronGroupedOutputProjection",
    "MegatronLightningIndexer",
    "csa_attention_spec",
    "default_backend",
    "get_core_attention_spec",
    "get_dsv4_attention_spec",
    "get_dsv4_layer_spec",
    "hca_attention_spec",
    "te_backend",
    "window_attention_spec",
]
