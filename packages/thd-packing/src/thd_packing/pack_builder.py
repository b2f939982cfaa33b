"""Materialise a scheduled :class:`~thd_packing.scheduler.Pack` into THD row tensors.

Each piece contributes its ``tokens / labels / loss_mask`` rows followed by per-document padding up to its aligned
length (tokens and labels ``pad_id``, loss mask 0); rows past the last document (``total_tokens`` larger than the
padded sum) are tail padding of the same kind.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from thd_packing.packed_seqs import PackedSeqs
from thd_packing.samples import VarlenDataset
from thd_packing.scheduler import Pack


def build_pack(
    dataset: VarlenDataset,
    pack: Pack,
    *,
    doc_index: Sequence[int] | None = None,
    total_tokens: int | None = None,
) -> tuple[PackedSeqs, dict[str, torch.Tensor]]:
    """``(PackedSeqs, {"tokens", "labels", "loss_mask"})`` of one pack, every tensor ``[T]``.

    Args:
        dataset: the documents.
        pack: pieces to place; ``piece.doc`` indexes ``doc_index`` when given (the iteration's documents), else
            the dataset directly.
        total_tokens: rows of the buffer (default: the padded sum).
    """
    pad = dataset.pad_id
    toks, labs, masks = [], [], []
    for piece, padded in zip(pack.pieces, pack.padded_lengths, strict=True):
        doc = piece.doc if doc_index is None else int(doc_index[piece.doc])
        sample = dataset[doc]
        stop = piece.start + piece.length
        if stop > len(sample):
            raise ValueError(f"piece {piece} runs past document {doc} of length {len(sample)}")
        extra = padded - piece.length
        toks += [sample.tokens[piece.start : stop], torch.full((extra,), pad, dtype=torch.int64)]
        labs += [sample.labels[piece.start : stop], torch.full((extra,), pad, dtype=torch.int64)]
        masks += [sample.loss_mask[piece.start : stop], torch.zeros(extra, dtype=torch.float32)]
    packed = PackedSeqs.from_lengths(
        [p.length for p in pack.pieces], list(pack.padded_lengths), total_tokens=total_tokens
    )
    tail = packed.total_tokens - pack.num_padded_tokens
    toks.append(torch.full((tail,), pad, dtype=torch.int64))
    labs.append(torch.full((tail,), pad, dtype=torch.int64))
    masks.append(torch.zeros(tail, dtype=torch.float32))
    tensors = {"tokens": torch.cat(toks), "labels": torch.cat(labs), "loss_mask": torch.cat(masks)}
    return packed, tensors
