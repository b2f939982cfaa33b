"""Fused vocab-parallel cross entropy (megatron-core ``vocab_parallel_cross_entropy`` semantics, one pass per row)."""

from dsv4_primitives.cross_entropy.apply import vocab_parallel_cross_entropy
from dsv4_primitives.cross_entropy.reference import vocab_parallel_cross_entropy_ref

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_cross_entropy_ref"]
