"""fp32 reference of shared-KV sparse attention with a per-head sink (dsv4-architecture.md §2.2).

One key/value buffer ``kv [Nkv, D]`` (K = V, a single head shared by all ``H`` query heads, MQA). Query row ``t``
attends to the rows listed in ``indices[t, :]`` (``-1`` = empty slot, ignored; a repeated row counts once per
occurrence, like a gather) in ONE softmax whose denominator also holds ``exp(attn_sink[h])`` (raw, not scaled):

    z[t,h,k] = softmax_scale * <q[t,h], kv[indices[t,k]]>            (-inf where indices[t,k] = -1)
    lse[t,h] = log( sum_k exp(z[t,h,k]) + exp(attn_sink[h]) )       (the sink IS inside lse)
    o[t,h]   = sum_k exp(z[t,h,k] - lse[t,h]) * kv[indices[t,k]]    (the sink has no value)

A row without any valid index gives ``o = 0`` and ``lse = attn_sink[h]``. ``attn_sink`` must be finite.

dtype policy: math in fp32 (fp64 when any input is fp64); ``o`` in ``q.dtype``; ``lse`` in the compute dtype.
Complexity: ``O(T * K * H * D)`` flops. Memory: chunked over ``T``; the largest intermediates per chunk of ``n`` rows
are the gathered rows ``[n, K, D]`` and the logits ``[n, H, K]`` (``n`` = ``chunk_size`` or chosen so that
``n * K * max(D, H) <= 2^24`` elements); backward recomputes one chunk at a time.
"""

from __future__ import annotations

import torch

from csa_kernels._checks import (
    check_shape,
    compute_dtype,
)
from csa_kernels._chunking import map_row_chunks, rows_per_chunk
from csa_kernels.ops.sparse_attn.checks import check_inputs as _check_inputs


def _attend_chunk(q, indices, kv, sink, scale):
    """One chunk: ``q [n, H, D]``, ``indices [n, K]`` -> ``o [n, H, D]``, ``lse [n, H]`` (compute dtype)."""
    valid = indices >= 0  # [n, K]
    rows = kv[indices.clamp(min=0).long()]  # [n, K, D]
    z = torch.einsum("nhd,nkd->nhk", q, rows) * scale  # [n, H, K]
    z = z.masked_fill(~valid[:, None, :], float("-inf"))
    sink_col = sink[None, :, None].expand(q.shape[0], -1, 1)  # [n, H, 1]
    lse = torch.logsumexp(torch.cat((z, sink_col), -1), -1)  # [n, H]
    p = torch.exp(z - lse[..., None])  # [n, H, K]
    return torch.einsum("nhk,nkd->nhd", p, rows), lse


def sparse_attn_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    attn_sink: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    chunk_size: int | None = None,
    *,
    check_indices: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather-form sparse attention with sink (module docstring).

    Args:
        q: ``[T, H, D]`` queries.
        kv: ``[Nkv, D]`` shared key/value rows (THD: ``kv_all = cat([kv, entries])``).
        attn_sink: ``[H]`` fp32 sink logits.
        indices: ``[T, K]`` int32 rows of ``kv``, ``-1`` = empty.
        softmax_scale: multiplies ``<q, k>`` (DSv4: ``D^-1/2``); not applied to the sink.
        chunk_size: query rows per chunk (``None``: automatic, see module docstring).
        check_indices: ``False`` skips the value checks that need a device -> host sync (``indices`` in
            ``[-1, Nkv)``, finite ``attn_sink``): the caller guarantees them; violations are undefined behaviour.
    Returns:
        ``o [T, H, D]`` (``q.dtype``), ``lse [T, H]`` (compute dtype). Differentiable in ``q``, ``kv``, ``attn_sink``.
    """
    _check_inputs(q, kv, attn_sink, indices, softmax_scale, check_indices)
    dt = compute_dtype(q, kv, attn_sink)
    _, h, d = q.shape
    k = indices.shape[1]
    chunk = rows_per_chunk(k * max(d, h), chunk_size)

    def fn(q_c, idx_c, kv_, sink_):
        return _attend_chunk(q_c, idx_c, kv_, sink_, float(softmax_scale))

    o, lse = map_row_chunks(fn, [q.to(dt), indices], [kv.to(dt), attn_sink.to(dt)], chunk)
    return o.to(q.dtype), lse


def sparse_attn_dense_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    attn_sink: torch.Tensor,
    mask: torch.Tensor,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense masked form (oracle A1): logits over ALL ``kv`` rows plus ``log(mask)`` (``-inf`` where 0).

    ``mask [T, Nkv]`` bool (candidate or not) or integer multiplicity (see
    :func:`csa_kernels.ops.visibility.indices_to_mask`; a row listed twice gets ``+log 2``, which reproduces the
    gather form's double counting). Materialises ``[T, H, Nkv]``: tests only.
    """
    check_shape(q, "q", (None, None, None))
    check_shape(mask, "mask", (q.shape[0], kv.shape[0]))
    dt = compute_dtype(q, kv, attn_sink)
    qf, kvf = q.to(dt), kv.to(dt)
    bias = torch.log(mask.to(dt))  # [T, Nkv], -inf where not a candidate
    z = torch.einsum("thd,sd->ths", qf, kvf) * softmax_scale + bias[:, None, :]  # [T, H, Nkv]
    sink_col = attn_sink.to(dt)[None, :, None].expand(q.shape[0], -1, 1)
    lse = torch.logsumexp(torch.cat((z, sink_col), -1), -1)  # [T, H]
    o = torch.einsum("ths,sd->thd", torch.exp(z - lse[..., None]), kvf)
    return o.to(q.dtype), lse
