"""Fast prefill of an empty :class:`~dsv4_attention.decode.cache.AttentionCache`: the training forward over the
prompts, then the cache filled from the prompt rows.

A call that starts every sequence (``plan.lengths`` all 0) needs no cached keys, so its outputs are exactly those of
the layer's own training forward over the prompts packed as THD documents (one per sequence, spec §3.5: positions
restart per document), with the fused csa-kernels path of that forward (fused indexer top-k over the whole prompt
instead of per-row scores at every visible entry plus a sort; one sparse attention over the pack)::

    y    = DSv4Attention.forward(x, THD layout of plan.row_starts)        # [R, d], eval: no indexer loss
    ring = project_kv(x) of the last n_win rows of each sequence           # WindowCache.append
    CSA / HCA entries, held compressor rows; CSA indexer keys               # CompressorCache.extend (the same
                                                                           # pooling ops as the eager extend)

The cache afterwards equals the eager :meth:`AttentionCache.extend` cache (``tests/test_decode_prefill.py``), so
decoding continues identically; the outputs equal the training forward (which the eager path matches within fp32
rounding).
"""

from __future__ import annotations

import torch

from dsv4_attention.attention import DSv4Attention
from dsv4_attention.decode.plan import ExtendPlan
from dsv4_attention.layout import TokenLayout
from dsv4_primitives.varlen import SeqBoundaries


def prompt_layout(plan: ExtendPlan, positions: torch.Tensor) -> TokenLayout:
    """The THD :class:`~dsv4_attention.layout.TokenLayout` of a first call's rows: one document per sequence
    (``cu_seqlens = plan.row_starts``; a sequence given no row is an empty document); ``positions [R]``:
    :meth:`ExtendPlan.row_positions`."""
    if any(plan.lengths):
        raise ValueError(f"a prompt layout needs empty sequences (lengths all 0), got lengths {plan.lengths}")
    bounds = SeqBoundaries.from_host(plan.row_starts, positions.device)
    return TokenLayout("thd", plan.num_rows, 1, bounds, positions, None, max(plan.counts))


def prefill(cache, attn: DSv4Attention, x: torch.Tensor, plan: ExtendPlan, dense: bool) -> torch.Tensor:
    """The layer output ``[R, d]`` of the prompts ``x [R, d]`` appended to the empty ``cache`` (an
    :class:`~dsv4_attention.decode.cache.AttentionCache`; module docstring); the cache then holds them."""
    core = attn.core_attention
    pos, seq = plan.row_positions(x.device), plan.row_sequences(x.device)  # [R], [R]
    y, _ = DSv4Attention.forward(attn, x, prompt_layout(plan, pos), dense=dense, indexer_loss_coeff=0.0)
    last = plan.ring_rows(cache.window.window, x.device)  # [N] the rows the ring keeps
    kv = attn.project_kv(x[last], pos[last], plan.max_position)  # [N, c]
    cache.window.write(kv, pos[last], seq[last])
    if cache.compressed is not None:
        cache.compressed.extend(core.compressor, x, plan, core.backend)
    if cache.indexer is not None:
        cache.indexer.extend(core.indexer, x, plan, core.backend)
    return y
