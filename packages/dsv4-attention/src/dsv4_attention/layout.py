"""SBHD / THD plumbing: turn megatron activations into the packed-token view that csa-kernels consumes.

* SBHD ``[s, b, h]``: sequence ``i`` of the batch becomes document ``i`` of a pack, ``cu_seqlens = [0, s, 2s, ...]``,
  positions ``0 .. s-1`` in every sequence.
* THD ``[t, 1, h]`` with ``PackedSeqParams(qkv_format="thd")``: documents ``[cu[i], cu[i+1])`` never see each other and
  positions restart at each document (spec §3.5, [OUR CHOICE]). With ``cu_seqlens_q_padded`` a document starts at its
  padded offset and the padding rows after its real tokens, like any rows past the last padded end (static-shape
  padding up to ``t``), form separate padding segments: they are computed (finite, ignored by the loss mask) but no
  real token ever attends to them, and they are excluded from the indexer loss.

Shape legend: ``s`` sequence, ``b`` batch, ``t``/``T`` packed tokens, ``h`` hidden, ``N`` segments.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch

from dsv4_primitives import positions_from_cu_seqlens
from dsv4_primitives.varlen import SeqBoundaries


@dataclass(frozen=True)
class TokenLayout:
    """How ``[T, ...]`` token rows map to the caller's activation layout.

    Attributes:
        qkv_format: ``"sbhd"`` or ``"thd"``.
        seq_len: ``s`` (SBHD) or ``t`` (THD) = leading dim of the activations.
        batch: ``b`` (1 for THD).
        bounds: the ``N+1`` segment boundaries over the ``T = s*b`` rows (documents and padding segments) as one
            :class:`dsv4_primitives.varlen.SeqBoundaries`, what every csa-kernels op takes: host boundaries (the
            device tensor and its host copy, so no kernel launcher reads the device back), or static ones on a
            static-shape THD layout (the CUDA-graph path, :func:`static_thd_layout`: device-only boundaries, every
            op with capacity shapes).
        positions: int64 ``[T]`` segment-relative positions.
        real_rows: bool ``[T]`` (False on THD padding rows) or ``None`` when every row is a real token.
        max_seqlen: longest segment.
        position_offset: constant added to every RoPE position (queries, keys, compressed entries, the output
            de-rotation): a sequence that continues at position ``position_offset``; 0 for ordinary batches.
            The layer output does not depend on it (oracle R4), only rounding does.
    """

    qkv_format: str
    seq_len: int
    batch: int
    bounds: SeqBoundaries
    positions: torch.Tensor
    real_rows: torch.Tensor | None
    max_seqlen: int
    position_offset: int = 0

    @property
    def is_static(self) -> bool:
        """Static-shape THD (device-only boundaries, capacity shapes: the CUDA-graph path)."""
        return self.bounds.is_static

    @property
    def max_rope_position(self) -> int:
        """A host upper bound of ``|position|`` over every RoPE position of the layer (tokens and compressed
        entries, which sit at ``w * ratio < segment length``): sizes the rotary table without reading the positions
        back from the device."""
        return max(self.max_seqlen - 1, 0) + abs(self.position_offset)

    def max_compressed_entries(self, ratio: int) -> int:
        """The largest per-segment compressed entry count ``floor(len / ratio)`` (host int, no device sync); on a
        static layout the capacity ``T // ratio`` (every entry index map and score matrix has that width); 0 for
        ``ratio = 0`` (no compressor)."""
        return self.bounds.max_entries(ratio) if ratio else 0

    @property
    def rope_positions(self) -> torch.Tensor:
        """int64 ``[T]`` positions used for RoPE (``positions + position_offset``)."""
        return self.positions + self.position_offset if self.position_offset else self.positions

    @property
    def num_tokens(self) -> int:
        return self.seq_len * self.batch

    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, b, *rest]`` -> ``[b*s, *rest]`` (document-major rows)."""
        if self.qkv_format == "thd":
            return x.reshape(x.shape[0], *x.shape[2:])
        return x.transpose(0, 1).reshape(self.num_tokens, *x.shape[2:])

    def from_tokens(self, y: torch.Tensor) -> torch.Tensor:
        """``[b*s, *rest]`` -> ``[s, b, *rest]``."""
        if self.qkv_format == "thd":
            return y.reshape(y.shape[0], 1, *y.shape[1:])
        return y.reshape(self.batch, self.seq_len, *y.shape[1:]).transpose(0, 1).contiguous()


def sbhd_layout(seq_len: int, batch: int, device=None) -> TokenLayout:
    """Layout of an SBHD batch: ``batch`` documents of ``seq_len`` tokens each."""
    key = (seq_len, batch, str(torch.device(device) if device is not None else "cpu"))
    cached = _SBHD_CACHE.get(key)
    if cached is not None:
        return cached
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device) * seq_len
    pos = torch.arange(seq_len, dtype=torch.int64, device=device).repeat(batch)
    bounds = SeqBoundaries(cu, tuple(i * seq_len for i in range(batch + 1)))
    layout = TokenLayout("sbhd", seq_len, batch, bounds, pos, None, seq_len)
    if torch.is_inference_mode_enabled():  # inference tensors could never be saved for a later backward
        return layout
    _remember(_SBHD_CACHE, key, layout, 16)  # a handful of (s, b) shapes per run
    return layout


# SBHD layouts are pure functions of (s, b, device) and hold no autograd state: every layer of a step (and every
# step) reuses one, instead of rebuilding its index tensors per layer
_SBHD_CACHE: dict[tuple, TokenLayout] = {}


def _remember(cache: dict, key, value, size: int) -> None:
    """Insert into a small cache that drops its oldest entry beyond ``size`` (never grows without bound)."""
    if len(cache) >= size:
        cache.pop(next(iter(cache)))
    cache[key] = value


def thd_layout(packed_seq_params, num_tokens: int, device=None) -> TokenLayout:
    """Layout of a packed THD batch of ``num_tokens`` rows described by megatron ``PackedSeqParams``.

    Building it reads the boundaries back to the host (one synchronisation); every layer of a step receives the same
    ``PackedSeqParams``, so the result is reused while the object and its boundary tensors are unchanged (same
    tensors, same in-place version counters: a static-shape buffer refilled in place is rebuilt).
    """
    if torch.is_inference_mode_enabled() or any(
        t is not None and t.is_inference() for t in _boundary_tensors(packed_seq_params)
    ):  # inference tensors have no version counter and could never be saved for a later backward: no reuse
        return _build_thd_layout(packed_seq_params, num_tokens, device)
    key = _thd_cache_key(packed_seq_params, num_tokens, device)
    hit = _THD_CACHE.get(key[0])
    if (
        hit is not None
        and hit[0]() is packed_seq_params
        and hit[1] == key[1:]
        and all(r() is t for r, t in zip(hit[3], _boundary_tensors(packed_seq_params)))
    ):
        return hit[2]
    layout = _build_thd_layout(packed_seq_params, num_tokens, device)
    try:  # weak references: a dead object or tensor (whose id / address may be reused) never matches
        ref = weakref.ref(packed_seq_params)
        tensor_refs = tuple(_weak_or_none(t) for t in _boundary_tensors(packed_seq_params))
    except TypeError:  # not weak-referenceable: no reuse
        return layout
    _remember(_THD_CACHE, key[0], (ref, key[1:], layout, tensor_refs), 8)
    return layout


_THD_CACHE: dict[int, tuple] = {}


_BOUNDARY_FIELDS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded")


def _boundary_tensors(psp) -> tuple:
    return tuple(getattr(psp, f, None) for f in _BOUNDARY_FIELDS)


def _weak_or_none(t):
    if t is None:
        return lambda: None
    return weakref.ref(t)


def _thd_cache_key(psp, num_tokens: int, device) -> tuple:
    def sig(t):
        return None if t is None else (t.data_ptr(), t._version, tuple(t.shape), t.dtype, str(t.device))

    return (id(psp), num_tokens, str(device), *(sig(t) for t in _boundary_tensors(psp)))


def _build_thd_layout(packed_seq_params, num_tokens: int, device=None) -> TokenLayout:
    psp = packed_seq_params
    if getattr(psp, "local_cp_size", None) is not None or getattr(psp, "cp_group", None) is not None:
        raise ValueError(
            "PackedSeqParams.local_cp_size / cp_group (dynamic context parallelism) is not supported by DSv4 "
            "attention; leave both None"
        )
    cu_q = psp.cu_seqlens_q
    if cu_q is None:
        raise ValueError("THD PackedSeqParams needs cu_seqlens_q (int32 [N+1] cumulative document lengths)")
    cu_q = cu_q.to(device=device, dtype=torch.int64)
    if cu_q.dim() != 1 or cu_q.numel() < 1 or int(cu_q[0]) != 0:
        raise ValueError(f"cu_seqlens_q must be 1-D, start at 0, got {cu_q.tolist()}")
    lengths = (cu_q[1:] - cu_q[:-1]).tolist()
    if any(n < 0 for n in lengths):
        raise ValueError(f"cu_seqlens_q must be non-decreasing, got {cu_q.tolist()}")
    cu_kv = psp.cu_seqlens_kv
    if cu_kv is not None and not torch.equal(cu_kv.to(device=device, dtype=torch.int64), cu_q):
        raise ValueError("self-attention needs cu_seqlens_kv == cu_seqlens_q (got different tensors)")
    padded = psp.cu_seqlens_q_padded
    if padded is None:
        starts = cu_q[:-1].tolist()
        ends_padded = cu_q[1:].tolist()
    else:
        padded = padded.to(device=device, dtype=torch.int64)
        if padded.shape != cu_q.shape:
            raise ValueError(
                f"cu_seqlens_q_padded shape {tuple(padded.shape)} differs from cu_seqlens_q {tuple(cu_q.shape)}"
            )
        starts = padded[:-1].tolist()
        ends_padded = padded[1:].tolist()
        if any(e - s < n for s, e, n in zip(starts, ends_padded, lengths)):
            raise ValueError("cu_seqlens_q_padded must leave room for every document's real tokens")
    total_used = ends_padded[-1] if ends_padded else 0
    if total_used > num_tokens:
        raise ValueError(
            f"packed documents cover {total_used} rows but the activations have only {num_tokens} (dim 0)"
        )
    bounds = [0]
    real = torch.zeros(num_tokens, dtype=torch.bool)
    for s, e, n in zip(starts, ends_padded, lengths):
        if s != bounds[-1]:
            raise ValueError(
                "documents of a THD pack must be contiguous (cu_seqlens[_padded] non-decreasing)"
            )
        bounds.append(s + n)
        real[s : s + n] = True
        bounds.append(e)  # padding segment (possibly empty)
    if num_tokens > bounds[-1]:
        bounds.append(num_tokens)  # trailing static-shape padding
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    pos = positions_from_cu_seqlens(cu, num_tokens)
    all_real = bool(real.all())
    seg = [b - a for a, b in itertools.pairwise(bounds)]
    return TokenLayout(
        "thd",
        num_tokens,
        1,
        SeqBoundaries(cu, tuple(bounds)),
        pos,
        None if all_real else real.to(device),
        max(seg) if seg else 0,
    )


STATIC_BOUNDS_ATTR = "dsv4_static_bounds"
_STATIC_LAYOUT_ATTR = "_dsv4_static_layout"


def mark_static_bounds(packed_seq_params):
    """Mark megatron ``PackedSeqParams`` (or any THD params object) as a static-shape pack: its layout is built on
    the device (:func:`static_thd_layout`) and every attention op runs with device-side boundaries and capacity
    shapes, so a CUDA graph captured on one pack replays correctly on another. Returns the same object."""
    setattr(packed_seq_params, STATIC_BOUNDS_ATTR, True)
    return packed_seq_params


def static_thd_layout(packed_seq_params, num_tokens: int, device=None) -> TokenLayout:
    """The static-shape layout of a THD pack of ``num_tokens`` rows, computed on the device only.

    The same segments as :func:`thd_layout` (each document's real rows, its padding rows up to
    ``cu_seqlens_q_padded``, the tail up to ``num_tokens``), as ``2 N + 2`` boundaries whatever the pack (empty
    segments where a document has no padding or the pack no tail), with ``max_seqlen = num_tokens``. No value is read
    back and nothing is validated (the caller's static buffers are trusted: the Trainer checks each batch on the host
    before it copies it in). ``N`` = ``len(cu_seqlens_q) - 1`` is the document capacity (unused slots repeat the end).
    """
    psp = packed_seq_params
    cu_q = psp.cu_seqlens_q
    if cu_q is None:
        raise ValueError("THD PackedSeqParams needs cu_seqlens_q (int32 [N+1] cumulative document lengths)")
    cu_q = cu_q.to(device=device, dtype=torch.int64)
    padded = psp.cu_seqlens_q_padded
    padded = cu_q if padded is None else padded.to(device=device, dtype=torch.int64)
    if padded.shape != cu_q.shape:
        raise ValueError(
            f"cu_seqlens_q_padded shape {tuple(padded.shape)} differs from cu_seqlens_q {tuple(cu_q.shape)}"
        )
    real_end = padded[:-1] + (cu_q[1:] - cu_q[:-1])  # [N] end of each document's real rows
    inner = torch.stack((real_end, padded[1:]), 1).reshape(-1)  # [2N] real end, padded end per document
    tail = torch.full((1,), num_tokens, dtype=torch.int64, device=cu_q.device)
    cu = torch.cat((cu_q[:1] * 0, inner, tail)).to(torch.int32)  # [2N + 2]
    bounds = SeqBoundaries.static(cu, num_tokens)
    doc = bounds.document_ids()  # [T] segment of every row (even = a document's real rows)
    real = (doc.remainder(2) == 0) & (doc < cu.numel() - 2)  # [T]: segment 2i = document i, 2N = the tail
    return TokenLayout("thd", num_tokens, 1, bounds, bounds.positions(), real, num_tokens)


def token_layout(hidden_states: torch.Tensor, packed_seq_params=None) -> TokenLayout:
    """The layout of attention input ``hidden_states`` (``[s, b, h]`` or ``[t, 1, h]`` with THD params).

    ``packed_seq_params``: ``None`` (SBHD), megatron ``PackedSeqParams`` (``qkv_format`` ``"thd"`` or ``"sbhd"``),
    or any object with ``to_packed_seq_params()`` (e.g. ``thd_packing.PackedSeqs``).
    """
    if hidden_states.dim() != 3:
        raise ValueError(
            f"hidden_states must be [s, b, h] (SBHD) or [t, 1, h] (THD), got shape {tuple(hidden_states.shape)}"
        )
    s, b, _ = hidden_states.shape
    if packed_seq_params is not None and hasattr(packed_seq_params, "to_packed_seq_params"):
        packed_seq_params = packed_seq_params.to_packed_seq_params()  # thd_packing.PackedSeqs
    fmt = getattr(packed_seq_params, "qkv_format", None) if packed_seq_params is not None else None
    if packed_seq_params is None or fmt == "sbhd":
        return sbhd_layout(s, b, hidden_states.device)
    if fmt != "thd":
        raise ValueError(f"PackedSeqParams.qkv_format must be 'thd' or 'sbhd', got {fmt!r}")
    if b != 1:
        raise ValueError(
            f"THD activations must be [t, 1, h] (batch dim 1), got shape {tuple(hidden_states.shape)}"
        )
    if getattr(packed_seq_params, STATIC_BOUNDS_ATTR, False):
        # built once per PackedSeqParams object (every layer of a micro-batch gets the same one; the Trainer makes a
        # new object per micro-batch): its derived maps (compressed bounds, document ids, row blocks) are shared
        key = (s, str(hidden_states.device))
        cached = getattr(packed_seq_params, _STATIC_LAYOUT_ATTR, None)
        if cached is not None and cached[0] == key:
            return cached[1]
        layout = static_thd_layout(packed_seq_params, s, hidden_states.device)
        if not torch.is_inference_mode_enabled():  # inference tensors could never be saved for a backward
            setattr(packed_seq_params, _STATIC_LAYOUT_ATTR, (key, layout))
        return layout
    return thd_layout(packed_seq_params, s, hidden_states.device)
