"""Packed-sequence (THD, flash-attn varlen) plumbing shared by every package.

- :mod:`~dsv4_primitives.varlen.checks`: validation of ``cu_seqlens`` and its host copy.
- :mod:`~dsv4_primitives.varlen.layout`: lengths <-> ``cu_seqlens`` <-> document ids / positions, compressed
  ``cu_seqlens`` of a ratio, SBHD <-> THD views.
- :mod:`~dsv4_primitives.varlen.upload`: host ints -> cached, capture-safe, read-only device constants.
- :class:`SeqBoundaries`: the one boundaries object of the ops: the device boundaries with their host copy, or
  (static mode, CUDA graphs) with a row capacity.
"""

from dsv4_primitives.varlen.boundaries import SeqBoundaries
from dsv4_primitives.varlen.checks import (
    check_cu_seqlens,
    check_cu_values,
    check_host_cu_seqlens,
    check_ratio,
)
from dsv4_primitives.varlen.layout import (
    compressed_cu_seqlens,
    compressed_cu_seqlens_host,
    cu_seqlens_from_lengths,
    document_ids,
    document_positions,
    lengths_from_cu_seqlens,
    sbhd_cu_seqlens,
    sbhd_cu_seqlens_host,
    sbhd_to_thd,
    thd_to_sbhd,
)
from dsv4_primitives.varlen.upload import upload_host_ints

__all__ = [
    "SeqBoundaries",
    "check_cu_seqlens",
    "check_cu_values",
    "check_host_cu_seqlens",
    "check_ratio",
    "compressed_cu_seqlens",
    "compressed_cu_seqlens_host",
    "cu_seqlens_from_lengths",
    "document_ids",
    "document_positions",
    "lengths_from_cu_seqlens",
    "sbhd_cu_seqlens",
    "sbhd_cu_seqlens_host",
    "sbhd_to_thd",
    "thd_to_sbhd",
    "upload_host_ints",
]
