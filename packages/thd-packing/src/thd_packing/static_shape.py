"""Static-shape THD padding for CUDA graphs (P11) and its inverse.

CUDA graphs replay fixed shapes, but a THD pack has a variable number of rows and of documents. Padding fixes both:

1. the buffer grows from ``T`` rows to ``token_capacity`` rows; with ``append_dummy_seq`` the new tail (together
   with any tail the pack already had past ``cu_seqlens_padded[-1]``) becomes one extra *dummy* document, so
   attention kernels see a well-formed pack and never read unowned rows;
2. every cu array grows to ``max_num_seqs + 1`` entries by repeating its last value (empty documents);
3. ``max_seqlen`` becomes ``token_capacity`` so the host-side integer never changes between replays.

The padded pack's document boundaries come as one static :class:`dsv4_primitives.varlen.SeqBoundaries`
(``StaticPack.bounds``: ``cu_seqlens_padded`` on the device with the row capacity ``token_capacity``, never read
back), what the csa-kernels ops take to run with capacity shapes inside a CUDA graph.

The returned ``padding_mask`` is True on every row that is not a real token of the original pack (per-document
padding, the dummy document, the tail): route it to the loss and to MoE so padding never counts.
:func:`unpad_static_shape` recovers the original pack and tensors exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from dsv4_primitives.varlen import SeqBoundaries
from thd_packing.packed_seqs import PackedSeqs


@dataclass(frozen=True)
class StaticShapeConfig:
    """Static capacities of a padded pack.

    Attributes:
        token_capacity: rows of every padded buffer (for contiguous CP: ``max_seqlen_per_dp_cp_rank * cp``).
        max_num_seqs: documents in every padded cu array (``max_num_seqs + 1`` entries), the dummy included.
        append_dummy_seq: cover the tail with a dummy document (True) or leave it outside every document.
    """

    token_capacity: int
    max_num_seqs: int
    append_dummy_seq: bool = True

    def __post_init__(self) -> None:
        if self.token_capacity < 1:
            raise ValueError(f"token_capacity must be >= 1, got {self.token_capacity}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


@dataclass(frozen=True)
class StaticPadInfo:
    """What :func:`unpad_static_shape` needs to undo the padding (host ints)."""

    num_tokens: int
    num_seqs: int
    max_seqlen: int


@dataclass(frozen=True, eq=False)
class StaticPack:
    """A padded pack: static ``packed`` metadata, padded ``tensors``, ``padding_mask`` ``[token_capacity]`` and
    ``bounds``, the static boundaries of its padded documents (``SeqBoundaries.static(cu_seqlens_padded,
    token_capacity)``; ``cu_seqlens_padded[-1] == token_capacity`` with the dummy tail document, at most it
    without)."""

    packed: PackedSeqs
    tensors: dict[str, torch.Tensor]
    padding_mask: torch.Tensor = field(repr=False)
    info: StaticPadInfo
    bounds: SeqBoundaries = field(repr=False)


def _pad_cu(cu: torch.Tensor, extra_last: int | None, entries: int) -> torch.Tensor:
    parts = [cu]
    if extra_last is not None:
        parts.append(cu[-1:] + extra_last)
    out = torch.cat(parts)
    return torch.cat([out, out[-1:].expand(entries - out.numel())])


def pad_to_static_shape(
    packed: PackedSeqs,
    tensors: Mapping[str, torch.Tensor],
    config: StaticShapeConfig,
    *,
    pad_values: Mapping[str, float | int | bool] | None = None,
    dim: int = 0,
) -> StaticPack:
    """Pad ``packed`` and its row tensors to the static shape of ``config``.

    Args:
        packed: the pack's metadata (``T = packed.total_tokens`` rows).
        tensors: row tensors of the pack, each with size ``T`` along ``dim`` (e.g. ``tokens [T]``,
            ``labels [T]``, ``loss_mask [T]``, ``hidden [T, H]``).
        config: the static capacities.
        pad_values: fill value per tensor name for the new rows (default 0; e.g. ``{"loss_mask": 0}``).
        dim: the row dimension of every tensor.

    Returns:
        :class:`StaticPack` with ``packed.total_tokens == config.token_capacity``,
        ``packed.cu_seqlens[_padded]`` of ``config.max_num_seqs + 1`` entries,
        ``packed.max_seqlen == config.token_capacity`` and the static ``bounds`` of the padded documents.
    """
    cap = config.token_capacity
    t = packed.total_tokens
    if t > cap:
        raise ValueError(
            f"the pack has {t} rows but token_capacity is {cap}; raise the capacity or pack fewer documents"
        )
    end = int(packed.cu_seqlens_padded[-1])
    add_dummy = config.append_dummy_seq and cap > end
    n = packed.num_seqs + int(add_dummy)
    if n > config.max_num_seqs:
        dummy = " plus the dummy tail document" if add_dummy else ""
        raise ValueError(
            f"the pack has {packed.num_seqs} documents{dummy} but max_num_seqs is {config.max_num_seqs}; raise "
            "max_num_seqs or cap documents per pack (SchedulerConfig.max_seqs_per_pack)"
        )
    tail = cap - end if add_dummy else None
    cu = _pad_cu(packed.cu_seqlens, tail, config.max_num_seqs + 1)
    cu_pad = _pad_cu(packed.cu_seqlens_padded, tail, config.max_num_seqs + 1)
    static = PackedSeqs.from_cu_seqlens(cu, cu_pad, total_tokens=cap, max_seqlen=cap)

    pad_values = dict(pad_values or {})
    unknown = set(pad_values) - set(tensors)
    if unknown:
        raise ValueError(f"pad_values names tensors that were not passed: {sorted(unknown)}")
    out: dict[str, torch.Tensor] = {}
    for name, x in tensors.items():
        if x.size(dim) != t:
            raise ValueError(f"tensor {name!r} has {x.size(dim)} rows along dim {dim}, expected {t}")
        shape = list(x.shape)
        shape[dim] = cap - t
        fill = torch.full(shape, pad_values.get(name, 0), dtype=x.dtype, device=x.device)
        out[name] = torch.cat([x, fill], dim=dim)
    mask = packed.padding_mask()
    padding_mask = torch.cat([mask, torch.ones(cap - t, dtype=torch.bool, device=mask.device)])
    info = StaticPadInfo(num_tokens=t, num_seqs=packed.num_seqs, max_seqlen=packed.max_seqlen)
    return StaticPack(static, out, padding_mask, info, SeqBoundaries.static(static.cu_seqlens_padded, cap))


def unpad_static_shape(static: StaticPack, *, dim: int = 0) -> tuple[PackedSeqs, dict[str, torch.Tensor]]:
    """Undo :func:`pad_to_static_shape`: the original ``PackedSeqs`` and row tensors (views, not copies)."""
    info = static.info
    n = info.num_seqs + 1
    packed = PackedSeqs.from_cu_seqlens(
        static.packed.cu_seqlens[:n],
        static.packed.cu_seqlens_padded[:n],
        total_tokens=info.num_tokens,
        max_seqlen=info.max_seqlen,
    )
    tensors = {name: x.narrow(dim, 0, info.num_tokens) for name, x in static.tensors.items()}
    return packed, tensors
