"""Input validation of the lightning indexer (:func:`~csa_kernels.indexer_scores`, ``indexer_scores_at``, ``indexer_topk``).

Shared by the fp32 reference and the Triton path (bad input -> ``ValueError`` saying what and how to fix); the
reference module holds the math only.
"""

from __future__ import annotations

from csa_kernels._checks import (
    check_cu_seqlens,
    check_float,
    check_index,
    check_ratio,
    check_shape,
)
from dsv4_primitives.varlen import compressed_cu_seqlens_host


def check_inputs(q_idx, k_idx, weights, ratio, cu_seqlens, cu_seqlens_c, cu_host=None, cuc_host=None):
    """Shapes, dtypes and the two ``cu_seqlens`` (host copies used when given: then no device sync); returns the
    validated host lists ``(cu, cuc)``."""
    check_shape(q_idx, "q_idx", (None, None, None))
    check_float(q_idx, "q_idx")
    t, h, d = q_idx.shape
    check_shape(k_idx, "k_idx", (None, d))
    check_float(k_idx, "k_idx")
    check_shape(weights, "weights", (t, h))
    check_ratio(ratio)
    cu = check_cu_seqlens(cu_seqlens, total=t, host=cu_host)
    cuc = check_cu_seqlens(cu_seqlens_c, "cu_seqlens_c", total=k_idx.shape[0], host=cuc_host)
    expected = compressed_cu_seqlens_host(cu, ratio)
    if cuc != expected:
        raise ValueError(f"cu_seqlens_c = {cuc} does not match floor(len / ratio) per document ({expected})")
    return cu, cuc


def check_scores_inputs(
    q_idx, k_idx, weights, ratio, cu_seqlens, cu_seqlens_c, max_entries, cu_host=None, cuc_host=None
):
    """:func:`check_inputs` plus the ``max_entries`` rule of the dense scores; returns ``(cu, cuc, max_entries)``."""
    cu, cuc = check_inputs(q_idx, k_idx, weights, ratio, cu_seqlens, cu_seqlens_c, cu_host, cuc_host)
    need = max((cuc[i + 1] - cuc[i] for i in range(len(cuc) - 1)), default=0)
    max_entries = need if max_entries is None else max_entries
    if not isinstance(max_entries, int) or max_entries < need:
        raise ValueError(
            f"max_entries must be an int >= {need} (largest document's entries), got {max_entries!r}"
        )
    return cu, cuc, max_entries


def check_scores_at_inputs(q_idx, k_idx, weights, indices, check_indices: bool = True) -> None:
    """Shapes, dtypes and index range of ``indexer_scores_at`` (reference and fused path)."""
    check_shape(q_idx, "q_idx", (None, None, None))
    check_float(q_idx, "q_idx")
    t, h, d = q_idx.shape
    check_shape(k_idx, "k_idx", (None, d))
    check_float(k_idx, "k_idx")
    check_shape(weights, "weights", (t, h))
    check_float(weights, "weights")
    check_index(indices, "indices", t, k_idx.shape[0], enabled=check_indices)
