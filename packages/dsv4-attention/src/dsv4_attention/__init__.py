"""dsv4-attention: DSv4 hybrid self-attention (window / CSA / HCA): a plain-PyTorch core and a megatron adapter.

Core (no megatron; see the package README):

- :class:`LayerKind`: window / CSA / HCA, from which the compress ratio, compressor overlap and indexer follow.
- :class:`DSv4Attention` + :class:`AttentionConfig`: one layer on packed token rows; :class:`CompressedSparseAttention`
  (+ :class:`CoreAttentionConfig`), :class:`Compressor` (+ :class:`CompressorConfig`), :class:`LightningIndexer`
  (+ :class:`IndexerConfig`), :class:`GroupedOutputProjection`: its submodules (paper names), frozen configs.
- :class:`IndexerLossAutoScaler`, :class:`IndexerLossTracker`, :func:`get_indexer_loss_tracker`: indexer-loss
  scheduling and logging.
- :func:`token_layout`, :class:`TokenLayout`: SBHD / THD plumbing; :func:`static_thd_layout` /
  :func:`mark_static_bounds`: static-shape THD (device-side boundaries) for CUDA graphs.
- :func:`parameter_table`: analytic parameter counts per layer kind.

megatron adapter (extra ``[megatron]``): :mod:`dsv4_attention.megatron` (``DSv4AttentionConfig``,
``DSv4HybridAttention``, the spec builders, ``DSv4TransformerLayer``).
"""

from __future__ import annotations

from dsv4_attention.attention import (
    AttentionConfig,
    DSv4Attention,
    build_core_attention,
    rope_config_for_kind,
)
from dsv4_attention.compressor import Compressor, CompressorConfig
from dsv4_attention.core import CompressedSparseAttention, CoreAttentionConfig
from dsv4_attention.grouped_projection import GroupedOutputProjection
from dsv4_attention.indexer import IndexerConfig, IndexerState, LightningIndexer
from dsv4_attention.indexer_loss import (
    IndexerLossAutoScaler,
    IndexerLossTracker,
    attach_indexer_loss,
    get_indexer_loss_tracker,
    indexer_loss_tracker_slot,
)
from dsv4_attention.kind import LAYER_KINDS, VALID_COMPRESS_RATIOS, LayerKind, check_compress_ratio
from dsv4_attention.layout import (
    TokenLayout,
    mark_static_bounds,
    sbhd_layout,
    static_thd_layout,
    thd_layout,
    token_layout,
)
from dsv4_attention.param_counts import parameter_table

__version__ = "0.9.0"

__all__ = [
    "LAYER_KINDS",
    "VALID_COMPRESS_RATIOS",
    "AttentionConfig",
    "CompressedSparseAttention",
    "Compressor",
    "CompressorConfig",
    "CoreAttentionConfig",
    "DSv4Attention",
    "GroupedOutputProjection",
    "IndexerConfig",
    "IndexerLossAutoScaler",
    "IndexerLossTracker",
    "IndexerState",
    "LayerKind",
    "LightningIndexer",
    "TokenLayout",
    "__version__",
    "attach_indexer_loss",
    "build_core_attention",
    "check_compress_ratio",
    "get_indexer_loss_tracker",
    "indexer_loss_tracker_slot",
    "mark_static_bounds",
    "parameter_table",
    "rope_config_for_kind",
    "sbhd_layout",
    "static_thd_layout",
    "thd_layout",
    "token_layout",
]
