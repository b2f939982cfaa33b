"""csa-kernels: DSv4 compressed sparse attention ops (see the package README and API.md for the contract).

Every op has an fp32 PyTorch reference (``*_ref``) and a public name without suffix that takes
``backend="auto" | "triton" | "reference"``; THD entry points take flash-attn varlen ``cu_seqlens`` and SBHD
entry points (``*_sbhd``) take an equal-length batch ``[S, B, ...]``.
"""

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
from csa_kernels.ops.compressor.static import compressor_pool_static
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
from csa_kernels.ops.indexer.static import indexer_scores_static, indexer_topk_static
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
from csa_kernels.static_bounds import (
    StaticBounds,
    visible_compressed_indices_static,
    window_indices_static,
)

__version__ = "0.4.0"

__all__ = [
    "CompressorState",
    "StaticBounds",
    "__version__",
    "attention_indices",
    "compress",
    "compress_ref",
    "compress_sbhd",
    "compressed_positions",
    "compressor_pool",
    "compressor_pool_ref",
    "compressor_pool_sbhd",
    "compressor_pool_static",
    "csa_dense_mask",
    "indexer_loss",
    "indexer_loss_ref",
    "indexer_loss_sbhd",
    "indexer_scores",
    "indexer_scores_at",
    "indexer_scores_at_ref",
    "indexer_scores_ref",
    "indexer_scores_sbhd",
    "indexer_scores_static",
    "indexer_teacher_ref",
    "indexer_topk",
    "indexer_topk_ref",
    "indexer_topk_sbhd",
    "indexer_topk_static",
    "indices_to_mask",
    "local_to_global_rows",
    "sparse_attn",
    "sparse_attn_dense_ref",
    "sparse_attn_ref",
    "sparse_attn_sbhd",
    "visible_compressed_indices",
    "visible_compressed_indices_sbhd",
    "visible_compressed_indices_static",
    "window_indices",
    "window_indices_sbhd",
    "window_indices_static",
]
