"""Compressors (spec §3): softmax-gated block pooling, overlapping (CSA) and plain (HCA), + RMSNorm + RoPE."""

from csa_kernels.ops.compressor.interface import (
    compress,
    compress_sbhd,
    compressor_pool,
    compressor_pool_sbhd,
)
from csa_kernels.ops.compressor.reference import compress_ref, compressed_positions, compressor_pool_ref
from csa_kernels.ops.compressor.streaming import CompressorState

__all__ = [
    "CompressorState",
    "compress",
    "compress_ref",
    "compress_sbhd",
    "compressed_positions",
    "compressor_pool",
    "compressor_pool_ref",
    "compressor_pool_sbhd",
]
