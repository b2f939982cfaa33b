"""The CP forward of :class:`~dsv4_attention.attention.DSv4Attention` (D8): local queries, extended keys.

Per layer on CP rank ``r`` (``x [L, d]`` local rows, plan = the kind's :class:`~dsv4_attention.cp.plan.KindPlan`):

    x_ext  = exchange_halo(x)                          # [h + L, d]   rows [e0, le), autograd all-gather
    E      = owned entries of the compressor(s) on x_ext, ONE gather launched async  (CSA / HCA; + indexer keys)
    q, cQ  = query path on the local rows x_ext[h:]     # [L, n_h, c], RoPE at the local positions
    kv     = RoPE(kv_layernorm(linear_kv_proj(x_ext)))  # [h + L, c]
    kv_all = cat(kv, E.wait())                          # [h + L + Tc, c]  compressed id g = CP=1's id g
    idx    = cat(window rows of kv, h + L + compressed ids)   # window / all visible (HCA, dense) / indexer top-k
    o, lse = sparse_attn(q, kv_all, sink, idx)          # then inverse RoPE and the output projections, local rows

Indexer loss (CSA, training): CP=1's per-row KL on the local rows; the returned value is this rank's PARTIAL
``sum(local valid rows) / (global valid-row count)`` (the count is a function of the global layout, computed on
every rank without communication), so the sum over CP ranks equals the CP=1 loss. Masked rows contribute zeros
that stay connected to the indexer's parameters: every rank's indexer gets a (possibly zero) gradient.
"""

from __future__ import annotations

import torch

from dsv4_attention._kernels import attention_indices, sparse_attn
from dsv4_attention._linears import linear_out
from dsv4_attention._rope import rope
from dsv4_attention.cp.compressed import start_owned_entries
from dsv4_attention.cp.halo import exchange_halo
from dsv4_attention.cp.indexer import local_queries, scores_at, select_topk
from dsv4_attention.indexer_kl import indexer_kl_sum
from dsv4_attention.indexer_loss import attach_indexer_loss
from dsv4_primitives import rms_norm


def kind_plan(attn, cpl):
    """The layer kind's cached plan on this rank."""
    core = attn.core_attention
    return cpl.plan(core.window, attn.kind.compress_ratio, attn.kind.overlap)


def forward_cp(
    attn, x: torch.Tensor, cpl, *, dense: bool, indexer_loss_coeff: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x [L, d]`` local rows -> ``(y [L, d], this rank's partial indexer loss or None)``."""
    big_l = cpl.num_local_tokens
    if x.shape[0] != big_l:
        raise ValueError(
            f"context-parallel rank {cpl.rank} expects its {big_l} local rows (T={cpl.global_layout.num_tokens} "
            f"/ CP={cpl.size}), got x with {x.shape[0]} rows"
        )
    core = attn.core_attention
    plan = kind_plan(attn, cpl)
    glob = cpl.global_layout
    max_pos = glob.max_rope_position
    backend = core.backend
    x_ext = exchange_halo(x, plan.halo_request, plan.halo, cpl)  # [h + L, d]
    # the query side reads the local rows as a VIEW of x_ext: the projections then keep one [h + L, d] buffer for
    # backward instead of x_ext and a second copy of the local rows (L * d elements per layer)
    x = x_ext[plan.halo :]  # [L, d]
    pending = None
    if core.compressor is not None:  # launch the gather first: it overlaps the query / key projections
        parts = [(core.compressor, x_ext)]
        if core.indexer is not None:  # the indexer's keys (detached input, as at CP=1) in the same collective
            parts.append((core.indexer.compressor, x_ext.detach()))
        pending = start_owned_entries(parts, plan, cpl, max_pos, backend)
    pos = cpl.local_positions  # [L]
    q_lat = attn.q_layernorm(linear_out(attn.linear_q_down_proj, x))  # [L, d_c]
    q = linear_out(attn.linear_q_up_proj, q_lat)  # [L, n_h*c]
    q = rms_norm(q.view(big_l, attn.num_heads, attn.head_dim), None, attn.eps)  # [L, n_h, c]
    q = rope(q, pos, attn.rope_cfg, max_position=max_pos, inplace=True)
    kv = linear_out(attn.linear_kv_proj, x_ext)  # [h + L, c]
    kv = rope(attn.kv_layernorm(kv), plan.ext_positions, attn.rope_cfg, max_position=max_pos, inplace=True)
    iq = None
    if core.indexer is not None:
        iq = local_queries(core.indexer, x, q_lat, pos, max_pos)
    o, loss = _core(core, q, kv, plan, cpl, pending, iq, dense, indexer_loss_coeff)  # [L, n_h, c]
    if loss is not None:
        o = attach_indexer_loss(o, loss)
    o = rope(o, pos, attn.rope_cfg, inverse=True, max_position=max_pos)
    u = linear_out(attn.linear_o_group_proj, o.reshape(big_l, attn.num_heads * attn.head_dim))  # [L, g*d_g]
    return linear_out(attn.linear_proj, u), loss  # [L, d]


def _core(core, q, kv, plan, cpl, pending, iq, dense, coeff):
    """Window / HCA / CSA attention of the local queries (the CP form of ``CompressedSparseAttention.forward``)."""
    backend = core.backend
    if pending is None:
        o, _ = sparse_attn(
            q, kv, core.attn_sink, plan.window, core.softmax_scale, backend=backend, check_indices=False
        )
        return o, None
    n_ext = kv.shape[0]
    gathered = pending.wait()  # ([Tc, c], [Tc, c_I] for CSA)
    kv_all = torch.cat((kv, gathered[0].to(kv.dtype)), 0)  # [h + L + Tc, c]
    k_idx = gathered[1] if core.indexer is not None else None  # [Tc, c_I]
    dense = core.indexer is None or dense
    want_loss = core.indexer is not None and core.training and torch.is_grad_enabled()
    topk_scores = None
    if dense:
        comp = plan.visible  # [L, max_c]
    else:
        comp, topk_scores = select_topk(core.indexer, iq, k_idx, plan, backend, want_loss)  # [L, k] streamed
    idx = attention_indices(plan.window, comp, n_ext)  # [L, W + K] rows of kv_all
    o, lse = sparse_attn(
        q, kv_all, core.attn_sink, idx, core.softmax_scale, backend=backend, check_indices=False
    )
    if not want_loss:
        return o, None
    if dense or not core.cfg.use_sparse_loss:
        loss_set = comp if dense else plan.visible  # [L, max_c] (the dense loss needs every visible entry)
        student = scores_at(iq, k_idx, loss_set, backend)  # [L, max_c]
    else:
        loss_set, student = comp, topk_scores  # [L, k]
    total, _ = indexer_kl_sum(
        q,
        kv_all,
        core.attn_sink,
        lse,
        loss_set,
        student,
        core.softmax_scale,
        n_ext,
        cpl.local_real_rows,
        backend,
    )
    partial = total / plan.loss_rows.clamp(min=1)
    return o, partial * coeff
