"""Bytes of a model's generation caches from its configuration (:func:`generation_cache_bytes`).

Sum over the main decoder's attention layers of :func:`dsv4_attention.decode.decode_cache_bytes`. Per sequence and
cached token the compressed entries dominate at long contexts::

    bytes / token ~ itemsize * (N_CSA * (c + c_I) / 4 + N_HCA * c / 128)

plus a constant ``itemsize * N_attn * n_win * c`` per sequence (every layer's window ring) and the compressors' held
block rows (``2 * 8 * 2c + 2 * 8 * 2c_I`` elements per CSA layer, ``2 * 128 * c`` per HCA layer). V4-Flash (21 CSA,
20 HCA, c = 512, c_I = 128), bf16: 6,880 B per token + 11.2 MiB per sequence (rings and held rows).
"""

from __future__ import annotations

from dsv4_attention import LayerKind
from dsv4_attention.decode import decode_cache_bytes
from hybrid_model.config import DSv4ModelConfig


def generation_cache_bytes(
    model_config: DSv4ModelConfig, max_length: int, *, batch: int = 1, itemsize: int = 4
) -> int:
    """Bytes of the :class:`~hybrid_model.generation.CachedDecoder` caches of a model of ``model_config`` for
    ``batch`` sequences of up to ``max_length`` tokens (``itemsize``: 4 for fp32, 2 for bf16)."""
    total = 0
    for symbol in model_config.parsed_pattern.main:
        if symbol in {kind.symbol for kind in LayerKind}:
            total += decode_cache_bytes(
                LayerKind.from_symbol(symbol),
                window=model_config.sliding_window,
                head_dim=model_config.head_dim,
                index_head_dim=model_config.index_head_dim,
                max_length=max_length,
                batch=batch,
                itemsize=itemsize,
            )
    return total
