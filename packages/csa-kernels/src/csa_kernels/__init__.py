"""csa-kernels: DSv4 compressed sparse attention ops (see the package README and API.md for the contract).

Every op has an fp32 PyTorch reference (``*_ref``) and a public name without suffix that takes
``backend="auto" | "triton" | "reference"``; THD entry points take the documents as one
:class:`~dsv4_primitives.varlen.SeqBoundaries` (host boundaries, or static ones for CUDA graphs)
and SBHD entry points (``*_sbhd``) take an equal-length batch ``[S, B, ...]``.
"""

from csa_kernels.determinism import (
    deterministic_default,
    deterministic_default_scope,
    set_deterministic_default,
)
from csa_kernels.ops.compressor import (
    CompressorState,
    compress,
    compress_ref,
    compress_sbhd,
    compressed_positions,
    compressor_pool,
    compressor_pool_ref,
    compressor_pool_sbhd,
)
from csa_kernels.ops.indexer import (
    indexer_scores,
    indexer_scores_at,
    indexer_scores_at_ref,
    indexer_scores_ref,
    indexer_scores_sbhd,
    indexer_topk,
    indexer_topk_ref,
    indexer_topk_sbhd,
)
from csa_kernels.ops.indexer_loss import (
    indexer_loss,
    indexer_loss_ref,
    indexer_loss_sbhd,
    indexer_teacher_ref,
)
from csa_kernels.ops.sparse_attn import (
    local_to_global_rows,
    sparse_attn,
    sparse_attn_dense_ref,
    sparse_attn_ref,
    sparse_attn_sbhd,
)
from csa_kernels.ops.visibility import (
    attention_indices,
    csa_dense_mask,
    indices_to_mask,
    visible_compressed_indices,
    visible_compressed_indices_sbhd,
    window_indices,
    window_indices_sbhd,
)

__version__ = "0.6.0"

__all__ = [
    "CompressorState",
    "__version__",
    "attention_indices",
    "compress",
    "compress_ref",
    "compress_sbhd",
    "compressed_positions",
    "compressor_pool",
    "compressor_pool_ref",
    "compressor_pool_sbhd",
    "csa_dense_mask",
    "deterministic_default",
    "deterministic_default_scope",
    "indexer_loss",
    "indexer_loss_ref",
    "indexer_loss_sbhd",
    "indexer_scores",
    "indexer_scores_at",
    "indexer_scores_at_ref",
    "indexer_scores_ref",
    "indexer_scores_sbhd",
    "indexer_teacher_ref",
    "indexer_topk",
    "indexer_topk_ref",
    "indexer_topk_sbhd",
    "indices_to_mask",
    "local_to_global_rows",
    "set_deterministic_default",
    "sparse_attn",
    "sparse_attn_dense_ref",
    "sparse_attn_ref",
    "sparse_attn_sbhd",
    "visible_compressed_indices",
    "visible_compressed_indices_sbhd",
    "window_indices",
    "window_indices_sbhd",
]
