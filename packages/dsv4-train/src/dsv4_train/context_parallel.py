"""``dsv4 train --cp N``: static contiguous context parallelism around the model: the groups and the batch each CP
rank feeds the model.

- Process groups: megatron's ``initialize_model_parallel(context_parallel_size=N)``; the model reads its CP group
  from ``ProcessGroupCollection.cp``; DP = world / (TP·PP·CP).
- Data: all CP ranks of a DP replica read the same global batch (sharded over DP only). A packed THD micro-batch
  is one pack of ``--seq-len`` rows (a multiple of ``N``); CP rank ``r`` takes its contiguous rows
  ``[r·L, (r+1)·L)``, ``L = seq_len / N`` (thd-packing's ``shard_contiguous_cp``; the dp-balanced scheduler packs for
  DP x CP with capacity ``N·L``), and every CP rank gets the *global* ``PackedSeqParams``.
- ``[B, S]`` batches run under CP > 1 as a THD pack of ``B`` documents of ``S`` tokens each (row ``b`` is document
  ``b``; its padding tail stays inside the document, as in the ``[B, S]`` layout): :func:`sbhd_as_thd_pack`,
  then the same contiguous slicing. At CP = 1 they stay ``[B, S]``.
- Under tensor parallelism (sequence parallelism) ``[B, S]`` batches run as the same THD pack (whole, at CP = 1;
  :mod:`dsv4_train.sequence_parallel`): the model's sequence-parallel shards are then contiguous rows of one pack,
  which DSv4 attention's TP layout takes (``dsv4_attention.tp``); an SBHD ``[S/tp, B]`` shard with ``B > 1`` is not.
- Only the contiguous layout: zigzag (or any layout that gives a rank non-adjacent rows) would cut DSv4's
  compression groups (4 / 128 consecutive tokens) and its sliding window across non-neighbouring ranks.
- Losses: every loss of a CP rank is its partial (:mod:`dsv4_primitives.cp_partial_loss`); the reported metrics
  are the global values (:meth:`~dsv4_train.step.StepRunner.reduced_losses`).

The trainer's one context-parallel module: the model side (its CP group, the MTP roll across rank edges) is
``hybrid_model.context_parallel`` / ``hybrid_model.mtp``, the attention side ``dsv4_attention.cp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dsv4_train.sequence_parallel import pad_pack_rows
from thd_packing import PackedSeqs, shard_contiguous_cp


@dataclass(frozen=True)
class LocalBatch:
    """One micro-batch as this rank feeds it to the model: ``tokens``/``labels``/``loss_mask``/``position_ids``/
    ``padding_mask`` ``[b, s]`` (``[1, L]`` under CP) and the pack's ``packed_seq_params`` (``None`` for ``[B, S]``)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    padding_mask: torch.Tensor
    packed_seq_params: Any


def sbhd_as_thd_pack(mb) -> tuple[dict[str, torch.Tensor], Any]:
    """``[B, S]`` micro-batch ``mb`` (an ``SbhdMicrobatch`` of whole rows) as one THD pack of ``B·S`` rows: row ``b``
    is document ``b`` of ``S`` tokens (``cu_seqlens = cu_seqlens_padded = [0, S, 2S, ..., B·S]``; a row's padding
    tail stays inside its document, masked by the loss mask and the padding mask exactly as in ``[B, S]``).
    Returns ``({field: [B·S] tensor}, PackedSeqs)``."""

    b, s = mb.tokens.shape
    if getattr(mb, "cp_size", 1) != 1:
        raise ValueError(
            f"sbhd_as_thd_pack needs whole [B, S] rows (cp_size 1), got a CP slice (cp_size {mb.cp_size})"
        )
    packed = PackedSeqs.from_lengths([s] * b, total_tokens=b * s)
    fields = {
        "tokens": mb.tokens.reshape(-1),
        "labels": mb.labels.reshape(-1),
        "loss_mask": mb.loss_mask.reshape(-1),
        "position_ids": packed.position_ids,
        "padding_mask": mb.padding_mask.reshape(-1),
    }
    return fields, packed


def local_batch(
    mb, *, packed: bool, cp_rank: int, cp_size: int, device: torch.device, tp_size: int = 1
) -> LocalBatch:
    """This rank's :class:`LocalBatch` of micro-batch ``mb``.

    Packed (``ThdMicrobatch``): its rows are already this CP rank's slice (the iterator shards by CP rank); the
    global ``PackedSeqParams``. ``[B, S]`` at CP = 1 and TP = 1: unchanged. ``[B, S]`` at CP > 1:
    :func:`sbhd_as_thd_pack`, then this rank's contiguous rows (``shard_contiguous_cp``) and the pack's global
    ``PackedSeqParams``. Under TP (``tp_size`` > 1, CP = 1) every TP rank gets the whole pack (``[B, S]`` as
    :func:`sbhd_as_thd_pack`), padded to a multiple of ``tp_size`` rows
    (:func:`~dsv4_train.sequence_parallel.pad_pack_rows`): the model cuts it into its sequence-parallel shards.
    Under TP x CP the CP rank's rows as without TP (packs and ``[B, S]`` packs of ``B`` documents alike; no padding:
    ``--seq-len`` is a multiple of ``cp·tp``, so the rows divide over TP), which the model cuts over TP.
    """

    names = [k for k in LocalBatch.__dataclass_fields__ if k != "packed_seq_params"]
    if packed:
        if mb.cp_size != cp_size or mb.cp_rank != cp_rank:
            raise ValueError(
                f"packed micro-batch of CP rank {mb.cp_rank}/{mb.cp_size} on CP rank {cp_rank}/{cp_size}: build the "
                "batch iterator with this rank's cp_rank and cp_size"
            )
        # this CP rank's rows of the pack (under TP x CP the model cuts them further)
        if tp_size == 1 or cp_size > 1:
            f = {k: getattr(mb, k)[None].to(device) for k in names}
            return LocalBatch(**f, packed_seq_params=mb.packed_seq_params())
        fields, pack = {k: getattr(mb, k) for k in names}, mb.packed_seqs
    elif cp_size == 1 and tp_size == 1:
        f = {k: getattr(mb, k).to(device) for k in names}
        return LocalBatch(**f, packed_seq_params=None)
    else:
        fields, pack = sbhd_as_thd_pack(mb)
    if tp_size > 1 and cp_size == 1:  # the whole pack, rows padded to a multiple of the TP size
        fields, pack = pad_pack_rows(fields, pack, tp_size)
    f = {k: shard_contiguous_cp(v, cp_rank, cp_size)[None].to(device) for k, v in fields.items()}
    return LocalBatch(**f, packed_seq_params=pack.to(device).to_packed_seq_params())


__all__ = ["LocalBatch", "local_batch", "sbhd_as_thd_pack"]
