"""megatron-core 0.19.2 integration of mHC (P2) and its pipeline transport (P3).

Imported explicitly (``import mhc.megatron``), never by ``import mhc``, so the ops stay usable without paying
megatron-core's import time. Needs the ``[megatron]`` extra (``pip install 'mhc[megatron]'``): without megatron-core
the import raises an ``ImportError`` naming it.

- :class:`HyperConnectionLayer` / :func:`hyper_connection_layer_spec`: any ``TransformerLayer`` built from a spec
  (attention-only, MLP/MoE-only, or both) as an mHC layer on ``[s, b, n·d]`` streams.
- :class:`HyperConnectionHybridStack` / :func:`hyper_connection_stack_spec`: a ``HybridStack`` that expands the
  embedding into ``n`` streams, wraps every layer, and collapses with the HyperHead before the final norm.
- :func:`mhc_p2p_tensor_shapes`, :func:`make_mhc_adjust_tensor_shapes_fn`, :func:`mhc_pipeline_hidden_size`: the
  ``n·d`` tensor shapes on inter-stage edges for megatron-core's pipeline schedules;
  :func:`mhc_pipeline_dtype` / :func:`check_mhc_pipeline_dtype`: their dtype (the stream dtype).
"""

from dsv4_primitives.extras import require_megatron

require_megatron("mhc[megatron]", "mhc.megatron")

from mhc.megatron.layer import HyperConnectionLayer, hyper_connection_layer_spec, mhc_config_for  # noqa: E402
from mhc.megatron.pipeline import (  # noqa: E402
    check_mhc_pipeline_dtype,
    fold_streams,
    make_mhc_adjust_tensor_shapes_fn,
    mhc_folded_seq_length,
    mhc_p2p_tensor_shapes,
    mhc_pipeline_dtype,
    mhc_pipeline_hidden_size,
    unfold_streams,
    uses_folded_streams,
)
from mhc.megatron.stack import HyperConnectionHybridStack, hyper_connection_stack_spec  # noqa: E402

__all__ = [
    "HyperConnectionHybridStack",
    "HyperConnectionLayer",
    "check_mhc_pipeline_dtype",
    "fold_streams",
    "hyper_connection_layer_spec",
    "hyper_connection_stack_spec",
    "make_mhc_adjust_tensor_shapes_fn",
    "mhc_config_for",
    "mhc_folded_seq_length",
    "mhc_p2p_tensor_shapes",
    "mhc_pipeline_dtype",
    "mhc_pipeline_hidden_size",
    "unfold_streams",
    "uses_folded_streams",
]
