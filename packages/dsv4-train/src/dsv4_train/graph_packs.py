"""``--cuda-graph --packed``: static-shape THD micro-batches for captured steps (issue 18, P11).

A captured step replays fixed shapes and fixed device buffers. A packed micro-batch from the batch iterator is
already static-shape (thd-packing's P11 padding, :mod:`thd_packing.static_shape`): ``--seq-len`` rows, the tail a
dummy document, and ``cu_seqlens`` / ``cu_seqlens_padded`` of ``max_docs_per_pack + 1`` entries (unused slots
repeat the end). Its boundaries change every step, so the captured step must read them from its static input
buffers on the device: :func:`static_pack_batch` adds them to the fields that ``FullCudaGraphWrapper`` copies in, and
:func:`static_packed_seq_params` turns the buffers back into megatron ``PackedSeqParams`` marked as static
(:func:`dsv4_attention.layout.mark_static_bounds`): the attention layers then build their layout on the device and
run csa-kernels' ops on static boundaries (capacity-sized grids, no host reads), so one capture serves every pack.

The document capacity is ``--max-docs-per-pack`` (:func:`max_docs_per_pack`): with ``--cuda-graph`` its default is
``min(seq_len, ceil(seq_len / m))`` for the dataset's shortest document ``m`` (a pack of whole documents never holds
more); eager ``--packed`` runs keep the batch iterator's default of 31 unless the flag is given. The scheduler
never puts more documents in a pack; a pack built elsewhere with more is refused (:func:`static_pack_batch`).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from dsv4_attention.layout import STATIC_BOUNDS_ATTR, mark_static_bounds

#: the tensors of a micro-batch that a captured step reads from its static buffers
BATCH_FIELDS = ("tokens", "labels", "loss_mask", "position_ids", "padding_mask")

PACK_FIELDS = (
    "cu_seqlens",
    "cu_seqlens_padded",
)  # the static pack's boundaries, copied with the batch fields

# thd-packing's BatchConfig.max_num_seqs default (32 slots: 31 documents + the dummy tail document)
EAGER_MAX_DOCS = 31


def max_docs_per_pack(requested: int | None, seq_len: int, cuda_graph: bool, min_doc_len: int | None) -> int:
    """The document capacity of a pack (the dummy tail document not counted).

    ``requested`` (``--max-docs-per-pack``) wins; else with ``cuda_graph`` ``min(seq_len, ceil(seq_len / m))`` for
    the dataset's shortest document ``m`` (``min_doc_len``; 1 when unknown), else :data:`EAGER_MAX_DOCS`.
    """
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--max-docs-per-pack must be >= 1, got {requested}")
        return requested
    if not cuda_graph:
        return EAGER_MAX_DOCS
    m = max(1, int(min_doc_len or 1))
    return min(seq_len, -(-seq_len // m))


def static_pack_batch(mb: Any, *, max_docs: int, step: int) -> dict[str, torch.Tensor]:
    """A packed micro-batch (``ThdMicrobatch``) as the dict of tensors ``FullCudaGraphWrapper`` copies into its static
    buffers: the batch fields ``[1, T]`` and the pack's ``cu_seqlens`` / ``cu_seqlens_padded`` int32
    ``[max_docs + 2]`` (the dummy tail document included; unused slots repeat the end).

    Raises ``ValueError`` when the pack holds more documents than the capacity (what, at which step, which flag).
    """
    packed = mb.packed_seqs
    slots = max_docs + 1  # the documents and the dummy tail document
    n = packed.cu_seqlens.numel() - 1
    if n > slots:
        raise ValueError(
            f"step {step + 1}: a packed micro-batch holds {n} documents (the dummy tail document included) but the "
            f"CUDA-graph static pack has room for {slots} (--max-docs-per-pack {max_docs} + 1): raise "
            f"--max-docs-per-pack to at least {n - 1}"
        )
    out = {name: getattr(mb, name)[None] for name in BATCH_FIELDS}  # [1, T]
    for name, cu in zip(PACK_FIELDS, (packed.cu_seqlens, packed.cu_seqlens_padded)):
        cu = cu.to(torch.int32)
        out[name] = torch.cat([cu, cu[-1:].expand(slots - n)]) if n < slots else cu  # [slots + 1]
    return out


def static_packed_seq_params(buffers: dict[str, torch.Tensor]):
    """megatron ``PackedSeqParams`` (THD, marked static) over the static buffers of :func:`static_pack_batch`."""

    cu, cu_pad = buffers["cu_seqlens"], buffers["cu_seqlens_padded"]
    t = buffers["tokens"].shape[-1]
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_pad,
        cu_seqlens_kv_padded=cu_pad,
        max_seqlen_q=t,
        max_seqlen_kv=t,
    )  # no total_tokens: megatron would upload it from the host (a pageable copy, illegal inside a capture)
    return mark_static_bounds(psp)


def is_static_pack(packed_seq_params) -> bool:
    """Whether ``packed_seq_params`` describes a static pack (device-only boundaries: no host reads allowed)."""

    return bool(getattr(packed_seq_params, STATIC_BOUNDS_ATTR, False))


__all__ = [
    "EAGER_MAX_DOCS",
    "PACK_FIELDS",
    "is_static_pack",
    "max_docs_per_pack",
    "static_pack_batch",
    "static_packed_seq_params",
]
