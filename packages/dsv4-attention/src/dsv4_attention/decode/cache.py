"""``AttentionCache``: prefill and decode of one DSv4 attention layer over a per-layer cache (no autograd).

For ``B`` independent sequences (no padding), one :class:`~dsv4_attention.decode.plan.ExtendPlan` call appends
``counts[b]`` rows to sequence ``b`` and returns the layer output of exactly those rows, equal to the training
forward's rows of the whole sequences (spec §2.2; fp32 rounding aside). With the layer's own modules and the
csa-kernels ops of the training path, per call (``x [R, d]``: the block input after ``attn_norm``)::

    cQ    = q_layernorm(linear_q_down_proj(x))                       # [R, d_c]
    q, kv = DSv4Attention.project_qkv(x, cQ, positions)              # [R, n_h, c], [R, c]  (RoPE at the positions)
    keys  = cat(window ring [B*W, c], kv [R, c], entries [B*C, c])   # one K = V buffer
    win   = the last n_win positions of each row (WindowCache)       # ring slots or this call's rows
    comp  = CSA: the indexer's top-k of the visible entries (dense phase: all of them, IndexerCache);
            HCA: every visible entry w < floor((p + 1) / m);  window layers: none
    o     = csa_kernels.sparse_attn(q, keys, attn_sink, [win | comp], c^-1/2)   # one softmax + sink
    y     = DSv4Attention.project_output(o, positions)               # inverse RoPE, wo_a, wo_b

What each kind caches per sequence (``W = n_win``, ``C = floor(max_length / m)``):

=======  ====================================================================================================
kind     cache
=======  ====================================================================================================
window   ring of the last ``W`` KV rows ``[W, c]``
HCA      the ring + entries ``[C, c]`` + the partial block's projected rows ``[m', 2 x c]`` (kv, gate logits)
CSA      the ring + entries ``[C, c]`` + indexer keys ``[C, c_I]`` + the last complete and the partial block's
         projected rows of both compressors ``[2m, 2 x 2c]`` and ``[2m, 2 x 2c_I]``
=======  ====================================================================================================

Speculative decoding verifies several drafted rows per call and keeps only a prefix of them: a call with
``undo=True`` keeps what :meth:`AttentionCache.rollback` needs to drop the newest rows again, exactly (the ring slots
the call overwrote and its rows, the compressors' document rows; :mod:`~dsv4_attention.decode.window`,
:mod:`~dsv4_attention.decode.compressed`). After ``rollback(lengths)`` the cache equals, buffer for buffer where a
later call reads, the cache of a call that appended only the kept rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_attention._kernels import attention_indices, sparse_attn
from dsv4_attention._linears import linear_out
from dsv4_attention.attention import DSv4Attention
from dsv4_attention.decode.compressed import CompressorCache
from dsv4_attention.decode.indexer import IndexerCache
from dsv4_attention.decode.plan import ExtendPlan
from dsv4_attention.decode.prefill import prefill
from dsv4_attention.decode.static import extend_static
from dsv4_attention.decode.step_indices import StepIndices
from dsv4_attention.decode.verify import PairIndices, extend_static_pair, rollback_static_pair
from dsv4_attention.decode.window import WindowCache


def visible_entries(
    plan: ExtendPlan, positions: torch.Tensor, sequences: torch.Tensor, ratio: int, capacity: int
):
    """int64 ``[R, V]``: the compressed entries visible to each new row (spec §3.4, oracle M1:
    ``w < floor((p + 1) / m)``), as global rows ``b * capacity + w`` of a ``[B * capacity]`` entry buffer, in
    increasing order, ``-1`` after; ``V = floor((max_position + 1) / m)``."""
    width = (plan.max_position + 1) // ratio
    w = torch.arange(width, device=positions.device)[None, :]  # [1, V]
    rows = sequences[:, None] * capacity + w  # [R, V]
    return torch.where(w < ((positions + 1) // ratio)[:, None], rows, -1)


@dataclass(frozen=True)
class _WindowUndo:
    """What :meth:`AttentionCache.rollback` needs of the last ``undo=True`` call's window rows."""

    plan: ExtendPlan
    positions: torch.Tensor  # [R]
    sequences: torch.Tensor  # [R]
    before: torch.Tensor  # [R, c] the ring slots' values before the call
    kv: torch.Tensor  # [R, c] the call's rows


class AttentionCache:
    """The decode cache of one :class:`~dsv4_attention.attention.DSv4Attention` (module docstring).

    Args:
        attn: the layer (its kind and sizes; parameters are read at every call, never copied).
        batch: ``B`` sequences.
        max_length: the longest sequence (prompt + generated tokens) the buffers are preallocated for.
        device, dtype: of the buffers (default: those of the layer's ``linear_kv_proj`` weight).
    """

    def __init__(self, attn: DSv4Attention, batch: int, max_length: int, *, device=None, dtype=None) -> None:
        if batch < 1 or max_length < 1:
            raise ValueError(
                f"AttentionCache needs batch >= 1 and max_length >= 1, got {batch} and {max_length}"
            )
        weight = next(attn.linear_kv_proj.parameters())
        device = weight.device if device is None else device
        dtype = weight.dtype if dtype is None else dtype
        core = attn.core_attention
        buffers = dict(device=device, dtype=dtype)
        self.kind = attn.kind
        self.max_length = max_length
        self.lengths: tuple[int, ...] = (0,) * batch
        self._device_lengths: torch.Tensor | None = None  # [B] the lengths on the device (None: not uploaded)
        self._undo: _WindowUndo | None = None
        self.pair_undo = None  # the last extend_static_pair's snapshot (rollback_static_pair)
        self.window = WindowCache(batch, core.window, attn.head_dim, **buffers)
        self.compressed = (
            None
            if core.compressor is None
            else CompressorCache(core.compressor, batch, max_length, **buffers)
        )
        self.indexer = (
            None if core.indexer is None else IndexerCache(core.indexer, batch, max_length, **buffers)
        )
        # one key buffer [B W | B | B C, c]: the ring and the entries are views of it, the B rows between them a
        # static decode step's new rows (extend_static attends it without concatenating)
        ring = batch * core.window
        entries = 0 if self.compressed is None else batch * self.compressed.capacity
        self.keys = torch.zeros(ring + batch + entries, attn.head_dim, **buffers)  # [B W + B + B C, c]
        self.window.kv = self.keys[:ring].view(self.window.kv.shape)
        if self.compressed is not None:
            self.compressed.entries = self.keys[ring + batch :].view(self.compressed.entries.shape)

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def device_lengths(self, device) -> torch.Tensor:
        """int64 ``[B]``: :attr:`lengths` on the device, advanced in place by every decode step (uploaded once
        after a call of another kind: prefill, a multi-row or ``undo`` call, :meth:`rollback`, :meth:`advance`)."""
        if self._device_lengths is None:
            self._device_lengths = torch.tensor(self.lengths, dtype=torch.int64, device=device)
        return self._device_lengths

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache's buffers (the ``B`` step rows of :attr:`keys` not counted)."""
        parts = (self.window, self.compressed, self.indexer)
        return sum(p.nbytes for p in parts if p is not None)

    def _check(self, attn: DSv4Attention, x: torch.Tensor, plan: ExtendPlan) -> None:
        if attn.kind is not self.kind:
            raise ValueError(f"this cache belongs to a {self.kind.name} layer, got a {attn.kind.name} layer")
        if plan.lengths != self.lengths:
            raise ValueError(
                f"the plan continues sequences of lengths {plan.lengths} but the cache holds {self.lengths}"
            )
        if max(plan.new_lengths) > self.max_length:
            raise ValueError(
                f"the call grows a sequence to {max(plan.new_lengths)} tokens but the cache was allocated for "
                f"max_length={self.max_length}; allocate it with a larger max_length"
            )
        if x.dim() != 2 or x.shape[0] != plan.num_rows:
            raise ValueError(f"x must be [R, d] with R = {plan.num_rows} rows, got {tuple(x.shape)}")

    @torch.no_grad()
    def extend(
        self,
        attn: DSv4Attention,
        x: torch.Tensor,
        plan: ExtendPlan,
        *,
        dense: bool = False,
        undo: bool = False,
        fast_prefill: bool = True,
    ) -> torch.Tensor:
        """The layer output ``[R, d]`` of the call's rows ``x [R, d]`` (module docstring); the cache then holds
        ``plan.new_lengths`` tokens per sequence. ``dense``: CSA's dense phase (every visible entry, no top-k).
        ``undo``: keep what :meth:`rollback` needs to drop some of the call's rows again. ``fast_prefill``: a
        first call (every sequence empty, no ``undo``) runs the layer's training forward over the prompts and
        fills the cache from them (:mod:`~dsv4_attention.decode.prefill`; the same cache as this eager path).

        A decode step (at most one row per sequence, no ``undo``, not a fast prefill) runs device-resident: the
        static step's math (:func:`~dsv4_attention.decode.static.extend_static`) on the fed sequences at the
        device lengths (:meth:`device_lengths`), no host sync and no upload (but the plan's row sequences when
        some sequence is not fed: one per step, shared by every layer). The step's index tensors (window slots,
        visible entries, compressor slots: :class:`~dsv4_attention.decode.step_indices.StepIndices`) are built by
        the step's first layer and shared through the plan by the others."""
        self._check(attn, x, plan)
        self._undo = None
        if fast_prefill and not undo and not any(self.lengths):
            y = prefill(self, attn, x, plan, dense)
            self.lengths, self._device_lengths = plan.new_lengths, None
            return y
        if plan.is_decode_step and not undo:
            lengths = self.device_lengths(x.device)  # [B]
            every = plan.num_rows == self.batch
            seq = None if every else plan.row_sequences(x.device)  # [R]

            def positions(_device) -> StepIndices:  # a copy: this layer advances its lengths in place
                return StepIndices(lengths.clone() if every else lengths[seq], self.batch, seq)

            indices = plan.shared("step indices", x.device, positions)  # one per step, shared by every layer
            fed = tuple(n for n, k in zip(plan.lengths, plan.counts) if k)  # the rows' positions on the host
            y = extend_static(
                self,
                attn,
                x,
                indices.lengths,
                dense=dense,
                sequences=seq,
                host_lengths=fed,
                indices=indices,
            )
            if every:
                lengths.add_(1)
            else:
                lengths.index_add_(0, seq, torch.ones_like(seq))
            self.lengths = plan.new_lengths
            return y
        self._device_lengths = None
        core = attn.core_attention
        pos, seq = plan.row_positions(x.device), plan.row_sequences(x.device)  # [R], [R]
        q_lat = attn.q_layernorm(linear_out(attn.linear_q_down_proj, x))  # [R, d_c]
        q, kv = attn.project_qkv(x, q_lat, pos, plan.max_position)  # [R, n_h, c], [R, c]
        keys = [self.window.kv.view(-1, kv.shape[-1]).to(kv.dtype), kv]
        idx = self.window.indices(plan, pos, seq)  # [R, W] rows of cat(ring, kv)
        if self.compressed is not None:
            self.compressed.extend(core.compressor, x, plan, core.backend, undo=undo)
            entries = self.compressed.entries  # [B, C, c]
            comp = visible_entries(plan, pos, seq, self.compressed.ratio, self.compressed.capacity)  # [R, V]
            if self.indexer is not None:
                self.indexer.extend(core.indexer, x, plan, core.backend, undo=undo)
            if self.indexer is not None and not dense:
                comp = self.indexer.select(
                    core.indexer, x, q_lat, plan.max_position, pos, comp, core.backend
                )  # [R, k]
            idx = attention_indices(idx, comp, self.batch * self.window.window + plan.num_rows)
            keys.append(entries.view(-1, entries.shape[-1]).to(kv.dtype))
        o, _ = sparse_attn(
            q,
            torch.cat(keys),
            core.attn_sink,
            idx,
            core.softmax_scale,
            backend=core.backend,
            check_indices=False,
        )  # [R, n_h, c]
        y = attn.project_output(o, pos, plan.max_position)  # [R, d]
        if undo:
            self._undo = _WindowUndo(plan, pos, seq, self.window.overwritten(pos, seq), kv)
        self.window.append(kv, plan, pos, seq)
        self.lengths = plan.new_lengths
        return y

    def rollback(self, lengths: tuple[int, ...]) -> None:
        """Drop the newest rows of the last call, made with ``undo=True``: sequence ``b`` keeps ``lengths[b]``
        tokens, between its length before and after that call (module docstring). One rollback per call."""
        undo = self._undo
        if undo is None:
            raise ValueError(
                "rollback needs the cache's last call to be extend(..., undo=True) (and no rollback since)"
            )
        lengths = tuple(int(n) for n in lengths)
        if len(lengths) != self.batch or not all(
            a <= n <= b for a, n, b in zip(undo.plan.lengths, lengths, undo.plan.new_lengths)
        ):
            raise ValueError(
                f"rollback lengths must lie between the last call's lengths {undo.plan.lengths} and "
                f"{undo.plan.new_lengths} per sequence, got {lengths}"
            )
        kept = tuple(n - a for n, a in zip(lengths, undo.plan.lengths))
        self.window.rollback(undo.plan, undo.positions, undo.sequences, undo.before, undo.kv, kept)
        if self.compressed is not None:
            self.compressed.rollback(lengths)
        if self.indexer is not None:
            self.indexer.keys.rollback(lengths)
        self.lengths, self._undo, self._device_lengths = lengths, None, None

    def extend_static(
        self,
        attn: DSv4Attention,
        x: torch.Tensor,
        lengths: torch.Tensor,
        *,
        dense: bool = False,
        indices: StepIndices | None = None,
    ) -> torch.Tensor:
        """One static-shape decode step (:func:`~dsv4_attention.decode.static.extend_static`): one row per
        sequence ``x [B, d]`` at the device positions ``lengths [B]``; returns ``[B, d]``. The host :attr:`lengths`
        are not read or advanced (the caller keeps them: :meth:`advance`). ``indices``: the step's
        :class:`~dsv4_attention.decode.step_indices.StepIndices` of ``lengths``, shared by every layer of the step."""
        if attn.kind is not self.kind:
            raise ValueError(f"this cache belongs to a {self.kind.name} layer, got a {attn.kind.name} layer")
        self._undo = None
        return extend_static(self, attn, x, lengths, dense=dense, indices=indices)

    def extend_static_pair(
        self, attn: DSv4Attention, x: torch.Tensor, *, dense: bool = False, indices: PairIndices
    ) -> torch.Tensor:
        """A static-shape speculative verify step (:func:`~dsv4_attention.decode.verify.extend_static_pair`):
        rows ``x [2B, d]`` at the device positions ``n`` and ``n + 1`` (``indices``); returns ``[2B, d]``. Drop
        the second rows again per sequence with :meth:`rollback_static_pair`. Host lengths untouched
        (:meth:`advance`)."""
        if attn.kind is not self.kind:
            raise ValueError(f"this cache belongs to a {self.kind.name} layer, got a {attn.kind.name} layer")
        self._undo = None
        return extend_static_pair(self, attn, x, dense=dense, indices=indices)

    def rollback_static_pair(self, accepted: torch.Tensor) -> None:
        """Drop the second row of the last :meth:`extend_static_pair` where ``accepted [B]`` is false (on the
        device, :func:`~dsv4_attention.decode.verify.rollback_static_pair`)."""
        rollback_static_pair(self, accepted)

    def advance(self, lengths: tuple[int, ...]) -> None:
        """Record the host lengths after static steps (the device lengths are the caller's)."""
        if len(lengths) != self.batch or max(lengths) > self.max_length:
            raise ValueError(
                f"advance needs {self.batch} lengths of at most max_length={self.max_length}, got {lengths}"
            )
        self.lengths = tuple(int(n) for n in lengths)
        self._device_lengths = None
