"""dsv4-attention: DSv4 hybrid self-attention (window / CSA / HCA) for megatron-core, SBHD and packed THD.

Public API (see the package README):

- :class:`DSv4AttentionConfig`: ``MLATransformerConfig`` subclass with the DSv4 fields and their validation.
- :class:`DSv4HybridAttention`: the ``self_attention`` module (one class, three layer kinds by ``compress_ratio``).
- :class:`CompressedSparseAttention`, :class:`Compressor`, :class:`LightningIndexer`,
  :class:`GroupedOutputProjection`: its submodules (paper names).
- :func:`get_dsv4_attention_spec` / :func:`get_dsv4_layer_spec` (+ ``window_/csa_/hca_attention_spec``),
  :class:`DSv4TransformerLayer`: ModuleSpec builders and the MTP-aware ``TransformerLayer``.
- :class:`IndexerLossAutoScaler`, :class:`IndexerLossTracker`, :func:`get_indexer_loss_tracker`: indexer-loss
  scheduling and logging.
- :func:`token_layout`, :class:`TokenLayout`: SBHD / THD plumbing.
- :func:`parameter_table`: analytic parameter counts per layer kind.
"""

from dsv4_attention.attention import DSv4HybridAttention, DSv4HybridAttentionSubmodules
from dsv4_attention.compressor import Compressor, CompressorSubmodules
from dsv4_attention.config import (
    LAYER_KINDS,
    VALID_COMPRESS_RATIOS,
    DSv4AttentionConfig,
    check_compress_ratio,
)
from dsv4_attention.core import CompressedSparseAttention, CompressedSparseAttentionSubmodules
from dsv4_attention.grouped_projection import GroupedOutputProjection
from dsv4_attention.indexer import LightningIndexer, LightningIndexerSubmodules
from dsv4_attention.indexer_loss import (
    IndexerLossAutoScaler,
    IndexerLossTracker,
    attach_indexer_loss,
    get_indexer_loss_tracker,
    indexer_loss_tracker_slot,
)
from dsv4_attention.layout import TokenLayout, sbhd_layout, thd_layout, token_layout
from dsv4_attention.param_counts import parameter_table
from dsv4_attention.specs import (
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

__version__ = "0.2.1"

__all__ = [
    "LAYER_KINDS",
    "VALID_COMPRESS_RATIOS",
    "CompressedSparseAttention",
    "CompressedSparseAttentionSubmodules",
    "Compressor",
    "CompressorSubmodules",
    "DSv4AttentionConfig",
    "DSv4HybridAttention",
    "DSv4HybridAttentionSubmodules",
    "DSv4TransformerLayer",
    "GroupedOutputProjection",
    "IndexerLossAutoScaler",
    "IndexerLossTracker",
    "LightningIndexer",
    "LightningIndexerSubmodules",
    "TokenLayout",
    "__version__",
    "attach_indexer_loss",
    "check_compress_ratio",
    "csa_attention_spec",
    "default_backend",
    "get_core_attention_spec",
    "get_dsv4_attention_spec",
    "get_dsv4_layer_spec",
    "get_indexer_loss_tracker",
    "hca_attention_spec",
    "indexer_loss_tracker_slot",
    "parameter_table",
    "sbhd_layout",
    "te_backend",
    "thd_layout",
    "token_layout",
    "window_attention_spec",
]
