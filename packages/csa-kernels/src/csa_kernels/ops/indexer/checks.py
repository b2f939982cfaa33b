"""Input validation of the lightning indexer (:func:`~csa_kernels.indexer_scores`, ``indexer_scores_at``, ``indexer_topk``).

Shared by the fp32 reference and the Triton path (bad input -> ``ValueError`` saying what and how to fix); the
reference module holds the math only.
"""

from __future__ import annotations

from csa_kernels._checks import (
    check_bounds,
    check_float,
    check_index,
    check_ratio,
    check_shape,
)


def check_inputs(q_idx, k_idx, weights, ratio, bounds):
    """Shapes, dtypes and the boundaries: ``q_idx`` has the ``T`` rows of ``bounds``, ``k_idx`` the rows of
    ``bounds.compressed(ratio)`` (``sum_i floor(len_i / ratio)``; static boundaries: the capacity ``T // ratio``).
    No device sync."""
    check_shape(q_idx, "q_idx", (None, None, None))
    check_float(q_idx, "q_idx")
    t, h, d = q_idx.shape
    check_shape(k_idx, "k_idx", (None, d))
    check_float(k_idx, "k_idx")
    check_shape(weights, "weights", (t, h))
    check_ratio(ratio)
    tc = check_bounds(bounds, t, "q_idx").compressed(ratio).total
    if k_idx.shape[0] != tc:
        what = (
            "the entry capacity T // ratio" if bounds.is_static else "sum of floor(len / ratio) per document"
        )
        raise ValueError(
            f"k_idx has {k_idx.shape[0]} rows but the boundaries hold {tc} compressed entries at ratio {ratio} "
            f"({what}); pass the keys of bounds.compressed({ratio})"
        )


def check_scores_inputs(q_idx, k_idx, weights, ratio, bounds, max_entries):
    """:func:`check_inputs` plus the ``max_entries`` rule of the dense scores; returns ``max_entries``."""
    check_inputs(q_idx, k_idx, weights, ratio, bounds)
    need = bounds.max_entries(ratio)
    max_entries = need if max_entries is None else max_entries
    if not isinstance(max_entries, int) or max_entries < need:
        what = "entry capacity T // ratio" if bounds.is_static else "largest document's entries"
        raise ValueError(f"max_entries must be an int >= {need} ({what}), got {max_entries!r}")
    return max_entries


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
