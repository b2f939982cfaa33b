"""Input validation of shared-KV sparse attention (:func:`~csa_kernels.sparse_attn`).

Shared by the fp32 reference and the Triton path (bad input -> ``ValueError`` saying what and how to fix); the
reference module holds the math only.
"""

from __future__ import annotations

import torch

from csa_kernels._checks import (
    check_float,
    check_index_layout,
    check_index_range,
    check_shape,
    check_softmax_scale,
)


def check_layout(q, kv, attn_sink, indices, softmax_scale):
    """Shapes, dtypes and scale, without a device sync (shared with the Triton path, which trusts index values)."""
    check_shape(q, "q", (None, None, None))
    check_float(q, "q")
    t, h, d = q.shape
    check_shape(kv, "kv", (None, d))
    check_float(kv, "kv")
    check_shape(attn_sink, "attn_sink", (h,))
    check_index_layout(indices, "indices", t)
    check_softmax_scale(softmax_scale)


def check_inputs(q, kv, attn_sink, indices, softmax_scale, check_indices: bool = True):
    """Layout plus the value checks that read the device back (index range, finite sink): skipped, sync-free,
    with ``check_indices=False``."""
    check_layout(q, kv, attn_sink, indices, softmax_scale)
    check_index_range(indices, "indices", kv.shape[0], enabled=check_indices)
    if check_indices and attn_sink.numel() and not torch.isfinite(attn_sink).all():
        raise ValueError("attn_sink must be finite (use a large negative value to switch the sink off)")
