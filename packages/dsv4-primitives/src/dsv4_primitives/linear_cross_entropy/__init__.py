"""Fused output head + cross entropy (vocab-chunked, vocab-parallel aware): the ``[T, V]`` logits never exist."""

from dsv4_primitives.linear_cross_entropy.apply import linear_cross_entropy
from dsv4_primitives.linear_cross_entropy.reference import linear_cross_entropy_ref

__all__ = ["linear_cross_entropy", "linear_cross_entropy_ref"]
