"""Static-shape decode step of one layer (:func:`extend_static`): one new token for EVERY sequence, the lengths a
device tensor, no host reads, so a whole-model step can be captured in a CUDA graph (issue 37).

The eager :meth:`AttentionCache.extend <dsv4_attention.decode.cache.AttentionCache.extend>` takes a host
:class:`~dsv4_attention.decode.plan.ExtendPlan` (any counts, prefill included): its shapes (visible entries up to the
longest sequence, which entries a call completes) and its per-sequence compressor loop depend on host lengths. In
lockstep decoding (``counts`` all 1) every shape is fixed by ``B`` and the cache capacity, so with ``n = lengths
[B]`` (device int64, the position of each new row) the same math runs on fixed shapes::

    keys     the layer's combined key buffer [B W | B | B C, c]: ring, this step's rows, entries (no concatenation)
    window   slot j of row b: s = n_b - W + 1 + j;  s = n_b -> B W + b;  0 <= s < n_b -> b W + s mod W;  s < 0 -> -1
    comp     every entry w < C = capacity, visible iff w < floor((n_b + 1) / m)  (-1 otherwise; HCA and dense CSA)
             CSA: the indexer's top-k over the same C columns (invisible -> -inf, never selected)
    held     the new projected row at slot n_b - start(n_b) (held rows keep the eager layout: positions
             [start(L), L)); a block completes iff (n_b + 1) mod m = 0, its entry w = (n_b + 1) / m - 1 pooled from
             the held rows as one document (CSA: blocks w - 1 and w, the document's entry 1; entry 0 when w = 0;
             HCA: block w) with csa-kernels' compressor_pool on [H, B, Dk], normed, rotated at w m and written
             where complete; CSA then moves block w to the front of the held rows (w >= 1)
    RoPE     every table sized by the capacity (max_position = max_length - 1, a host constant)

so the outputs equal the eager step's (the same ops on the same rows; only the masked tails of the index lists are
longer). Refused: a sequence at its capacity (the caller checks the host lengths).

The eager decode step (:meth:`AttentionCache.extend <dsv4_attention.decode.cache.AttentionCache.extend>` of at most
one row per sequence) is this step too, on the fed sequences only (``sequences [R]``: their rows, ``lengths [R]``
their positions; step row ``r`` is key ``B W + r``) and with the host lengths (``host_lengths``) to skip the pooling
when no block completes.
"""

from __future__ import annotations

import torch

from dsv4_attention._kernels import attention_indices, compressor_pool_sbhd, sparse_attn
from dsv4_attention._linears import linear_out
from dsv4_attention._rope import rope
from dsv4_attention.compressor import Compressor
from dsv4_attention.decode.compressed import CompressorCache
from dsv4_attention.decode.step_indices import CompressSlots, StepIndices

__all__ = ["compress_static", "extend_static"]


def compress_static(
    cache: CompressorCache,
    compressor: Compressor,
    x: torch.Tensor,
    slots: CompressSlots,
    max_position: int,
    backend: str = "auto",
    host_lengths: tuple[int, ...] | None = None,
) -> None:
    """Consume one row per sequence ``x [R, d]`` (of the distinct sequences ``slots.rows``): hold its projections,
    emit the entries the step completes (module docstring; ``slots``: :meth:`StepIndices.compress`). Every
    sequence's held rows are pooled; only the rows' sequences change. ``host_lengths``: the rows' positions known on
    the host (an eager step): when no row completes a block, nothing is pooled (``None``: a static step, which
    always pools and masks)."""
    m, b = cache.ratio, slots.rows
    cache.held_kv[b, slots.slot] = linear_out(compressor.linear_wkv, x).to(cache.held_kv.dtype)  # [R, Dk]
    cache.held_score[b, slots.slot] = linear_out(compressor.linear_wgate, x).to(cache.held_score.dtype)
    if host_lengths is not None and not any((n + 1) % m == 0 for n in host_lengths):
        return  # no block completes (host knowledge: no host read)
    doc = compressor_pool_sbhd(
        cache.held_kv.transpose(0, 1).contiguous(),
        cache.held_score.transpose(0, 1).contiguous(),
        compressor.ape,
        m,
        cache.overlap,
        backend=backend,
    )  # [H / m, B, c] fp32
    if slots.subset:
        doc = doc[:, b]  # [H / m, R, c]
    pooled = torch.where(slots.first, doc[0], doc[-1]) if cache.overlap else doc[0]  # [R, c]
    out = rope(compressor.norm(pooled), slots.entry_position, compressor.rope_cfg, max_position=max_position)
    if cache.capacity:  # (no block completes within a capacity of 0 entries)
        current = cache.entries[b, slots.entry]  # [R, c]
        cache.entries[b, slots.entry] = torch.where(slots.complete, out.to(cache.entries.dtype), current)
    if cache.overlap:  # the completed block becomes the held previous block
        for held in (cache.held_kv, cache.held_score):
            rows = held[b]  # [R, H, Dk]
            held[b, :m] = torch.where(slots.shift, rows[:, m:], rows[:, :m])


@torch.no_grad()
def extend_static(
    cache,
    attn,
    x: torch.Tensor,
    lengths: torch.Tensor,
    *,
    dense: bool = False,
    sequences: torch.Tensor | None = None,
    host_lengths: tuple[int, ...] | None = None,
    indices: StepIndices | None = None,
) -> torch.Tensor:
    """The layer output ``[R, d]`` of one new row per sequence ``x [R, d]`` at positions ``lengths [R]`` (device
    int64; the caller advances them after the step). ``cache``: the layer's
    :class:`~dsv4_attention.decode.cache.AttentionCache`; ``dense``: CSA's dense phase. ``sequences``: device int64
    ``[R]``, the distinct sequences of the rows (a subset: the others are not fed); ``None``: all ``B`` in order.
    ``host_lengths``: ``lengths`` as host ints when the caller knows them (:func:`compress_static`). ``indices``: the
    step's :class:`~dsv4_attention.decode.step_indices.StepIndices` of these ``lengths`` / ``sequences``, shared by
    every layer of the step (``None``: built for this layer alone)."""
    core = attn.core_attention
    bsz, ring = cache.batch, cache.window
    rows = bsz if sequences is None else sequences.shape[0]
    if x.dim() != 2 or x.shape[0] != rows or lengths.shape != (rows,) or rows > bsz:
        raise ValueError(
            f"a static decode step takes one row per sequence: x [{rows}, d] and lengths [{rows}] (at most "
            f"{bsz} rows), got {tuple(x.shape)} and {tuple(lengths.shape)}"
        )
    if indices is None:
        indices = StepIndices(lengths, bsz, sequences)
    max_position = cache.max_length - 1
    q_lat = attn.q_layernorm(linear_out(attn.linear_q_down_proj, x))  # [R, d_c]
    q, kv = attn.project_qkv(x, q_lat, lengths, max_position)  # [R, n_h, c], [R, c]
    offset = bsz * ring.window
    cache.keys[offset : offset + rows] = kv.to(cache.keys.dtype)  # this step's rows
    comp = cache.compressed
    if comp is None:
        idx = indices.window(ring.window)  # [R, W]
    else:
        slots = indices.compress(comp.ratio, comp.overlap)
        compress_static(comp, core.compressor, x, slots, max_position, core.backend, host_lengths)
        if cache.indexer is not None:
            keys = cache.indexer.keys
            slots = indices.compress(keys.ratio, keys.overlap)
            compress_static(keys, core.indexer.compressor, x, slots, max_position, core.backend, host_lengths)
        if cache.indexer is None or dense:
            idx = indices.attention(ring.window, comp.ratio, comp.capacity)  # [R, W + C]
        else:
            visible = indices.visible(comp.ratio, comp.capacity)  # [R, C]
            top = cache.indexer.select(
                core.indexer, x, q_lat, max_position, lengths, visible, core.backend
            )  # [R, k]
            idx = attention_indices(indices.window(ring.window), top, offset + bsz)
    o, _ = sparse_attn(
        q, cache.keys, core.attn_sink, idx, core.softmax_scale, backend=core.backend, check_indices=False
    )  # [R, n_h, c]
    y = attn.project_output(o, lengths, max_position)  # [R, d]
    ring.kv[indices.rows, lengths.remainder(ring.window)] = kv.to(ring.kv.dtype)
    return y
