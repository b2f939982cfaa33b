"""``dsv4 train --tp N``: the pack every TP rank feeds the model under sequence parallelism.

Every TP rank of a group reads the same micro-batch and feeds all of it with the *global* ``PackedSeqParams``; the
model cuts the rows into the sequence-parallel shards itself (megatron's scatter of the embedding output: rank ``r``
holds rows ``[r·T/N, (r+1)·T/N)``; DSv4 attention's TP layout, the MTP roll and the routers' document intervals are
built from the global pack). So under TP a micro-batch is one THD pack of ``T`` rows, ``T`` a multiple of ``N``:

- ``--packed``: the iterator's pack (``--seq-len`` rows, its static dummy tail included);
- ``[B, S]``: the THD pack of ``B`` documents of ``S`` tokens (:func:`~dsv4_train.context_parallel.sbhd_as_thd_pack`;
  README "Tensor parallelism" says why not SBHD shards);
- ``T`` not a multiple of ``N``: :func:`pad_pack_rows` appends ``round_up(T, N) - T < N`` rows after the last
  document, outside every document (thd-packing's static-shape padding without a dummy document): token 0, label 0,
  loss mask 0, padding mask True. They change no loss: the LM / MTP losses mask them (the masked mean's count is
  unchanged), the routers skip padding rows (balance loss and expert loads), the routers' extra tail interval holds
  no valid token (left out of the per-document mean), DSv4 attention runs them as a trailing padding segment (no
  real row reads them; the indexer loss counts real rows only) and the MTP roll fills them.
"""

from __future__ import annotations

import torch

from thd_packing import PackedSeqs
from thd_packing.packed_seqs import round_up
from thd_packing.static_shape import StaticShapeConfig, pad_to_static_shape


def pad_pack_rows(
    fields: dict[str, torch.Tensor], pack: PackedSeqs, multiple: int
) -> tuple[dict[str, torch.Tensor], PackedSeqs]:
    """``fields`` (``[T]`` row tensors: tokens, labels, loss_mask, position_ids, padding_mask) and their ``pack``
    padded to ``round_up(T, multiple)`` rows (module docstring); unchanged when ``T`` is already a multiple."""

    t = pack.total_tokens
    rows = round_up(t, multiple)
    if rows == t:
        return fields, pack
    config = StaticShapeConfig(rows, max(pack.num_seqs, 1), append_dummy_seq=False)
    static = pad_to_static_shape(pack, fields, config, pad_values={"padding_mask": True})
    return static.tensors, static.packed


__all__ = ["pad_pack_rows"]
