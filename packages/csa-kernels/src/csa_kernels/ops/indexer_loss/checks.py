"""Input validation of the indexer KL loss (:func:`~csa_kernels.indexer_loss`).

Shared by the fp32 reference and the Triton path (bad input -> ``ValueError`` saying what and how to fix); the
reference module holds the math only.
"""

from __future__ import annotations

from csa_kernels._checks import check_float, check_index, check_shape, check_softmax_scale


def check_inputs(q, kv_all, attn_sink, lse, comp_indices, index_scores, softmax_scale, check_indices=True):
    check_shape(q, "q", (None, None, None))
    check_float(q, "q")
    t, h, d = q.shape
    check_shape(kv_all, "kv_all", (None, d))
    check_shape(attn_sink, "attn_sink", (h,))
    check_shape(lse, "lse", (t, h))
    check_index(comp_indices, "comp_indices", t, kv_all.shape[0], enabled=check_indices)
    check_shape(index_scores, "index_scores", tuple(comp_indices.shape))
    check_float(index_scores, "index_scores")
    check_softmax_scale(softmax_scale)
