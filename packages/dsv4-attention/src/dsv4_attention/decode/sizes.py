"""Bytes of a decode cache (:class:`~dsv4_attention.decode.cache.AttentionCache`) from the layer sizes alone.

Per sequence, in elements (``W = n_win``, ``c`` head dim, ``c_I`` indexer head dim, ``L`` = ``max_length``)::

    window   W c
    HCA      W c + floor(L / 128) c + 2 * 128 * c                       (ring, entries, held rows: kv + gate logits)
    CSA      W c + floor(L / 4) (c + c_I) + 2 * 8 * 2c + 2 * 8 * 2 c_I   (ring, entries + indexer keys, held rows of
                                                                         both overlapping compressors)

so a model needs ``sum over layers`` of these times ``B`` times the element size; per cached token that is
``(N_CSA (c + c_I) / 4 + N_HCA c / 128)`` elements plus a constant ``N_layers W c`` per sequence (the rings) and the
held compressor rows.
"""

from __future__ import annotations

from dsv4_attention.kind import LayerKind


def _compressor_elements(kind: LayerKind, head_dim: int, max_length: int) -> int:
    m = kind.compress_ratio
    width = (2 if kind.overlap else 1) * head_dim  # Dk
    held = (2 if kind.overlap else 1) * m  # rows of the held blocks
    return 2 * held * width + (max_length // m) * head_dim  # kv + gate rows, entries


def decode_cache_bytes(
    kind: LayerKind,
    *,
    window: int,
    head_dim: int,
    index_head_dim: int,
    max_length: int,
    batch: int = 1,
    itemsize: int = 4,
) -> int:
    """Bytes of one layer's :class:`AttentionCache` for ``batch`` sequences of up to ``max_length`` tokens
    (``itemsize``: bytes per element of the cache dtype, 4 for fp32)."""
    elements = window * head_dim
    if kind.has_compressor:
        elements += _compressor_elements(kind, head_dim, max_length)
    if kind.has_indexer:
        elements += _compressor_elements(LayerKind.CSA, index_head_dim, max_length)
    return elements * batch * itemsize
