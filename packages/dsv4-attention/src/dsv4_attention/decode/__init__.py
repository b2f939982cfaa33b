"""Cached prefill / decode of DSv4 attention (issue 37): a per-layer cache per layer kind, plain PyTorch.

- :class:`ExtendPlan`: the new rows of one call (``counts[b]`` tokens appended to sequence ``b``, which holds
  ``lengths[b]``); prefill is the first call, a decode step a call of one row per sequence.
- :class:`AttentionCache`: one layer's cache (window ring; CSA / HCA compressor state and entries; CSA indexer keys
  and the top-k recomputed for every row); :meth:`AttentionCache.extend` returns the layer output of the new rows,
  equal to the training forward (the same modules and csa-kernels ops).
- :func:`extend_static` (:meth:`AttentionCache.extend_static`): a lockstep decode step with device-side lengths and
  static shapes (CUDA-graph capturable); :func:`bind_static_decode_step` binds it like :func:`bind_decode_step`;
  :class:`StepIndices`: a decode step's position-derived index tensors, built once per step for every layer.
- :func:`extend_static_pair` / :func:`rollback_static_pair` (:meth:`AttentionCache.extend_static_pair`): a static
  speculative verify step (two rows per sequence) and the per-sequence on-device drop of its second rows;
  :func:`bind_static_verify_step` binds it; :class:`PairIndices`: its two rows' :class:`StepIndices`.
- :func:`bind_decode_step`: route a megatron ``DSv4HybridAttention`` through its cache (whole-model decoding:
  ``hybrid_model.generation``).
- :func:`decode_cache_bytes`: a layer cache's size from the layer sizes; :func:`select_topk`: the top-k tie rule.
"""

from __future__ import annotations

from dsv4_attention.decode.binding import bind_decode_step, bind_static_decode_step, bind_static_verify_step
from dsv4_attention.decode.cache import AttentionCache, visible_entries
from dsv4_attention.decode.compressed import CompressorCache
from dsv4_attention.decode.indexer import IndexerCache, select_topk
from dsv4_attention.decode.plan import ExtendPlan
from dsv4_attention.decode.sizes import decode_cache_bytes
from dsv4_attention.decode.static import extend_static
from dsv4_attention.decode.step_indices import StepIndices
from dsv4_attention.decode.verify import PairIndices, extend_static_pair, rollback_static_pair
from dsv4_attention.decode.window import WindowCache

__all__ = [
    "AttentionCache",
    "CompressorCache",
    "ExtendPlan",
    "IndexerCache",
    "PairIndices",
    "StepIndices",
    "WindowCache",
    "bind_decode_step",
    "bind_static_decode_step",
    "bind_static_verify_step",
    "decode_cache_bytes",
    "extend_static",
    "extend_static_pair",
    "rollback_static_pair",
    "select_topk",
    "visible_entries",
]
