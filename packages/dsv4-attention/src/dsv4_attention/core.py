"""Core attention of one DSv4 layer: window + compressed entries + sink in one softmax (spec §2.2, §3.4, §4, §5).

``CompressedSparseAttention`` covers the three layer kinds (paper names):

* ratio 0, sliding-window attention: keys = the last ``n_win`` raw tokens of the document (incl. the query);
* ratio 128, heavily compressed attention (HCA): window + every visible compressed entry (``w < floor((t+1)/128)``);
* ratio 4, compressed sparse attention (CSA): window + the lightning indexer's top-k visible entries (sparse phase)
  or every visible entry (dense phase, ``config.csa_dense_mode``).

Shared-KV MQA (K = V = ``kv_all = cat(kv [T, c], entries [Tc, c])``), per-head fp32 sink logit used raw:

    p[h,t,j] = exp(z[h,t,j]) / (sum_j' exp(z[h,t,j']) + exp(attn_sink[h])),  z = <q[t,h], K_j> / sqrt(c)
    o[t,h]   = sum_j p[h,t,j] K_j

CSA layers also compute the indexer KL loss (§5.2; teacher = the main attention's probabilities under its full
denominator, summed over heads, L1-normalised over the loss set; student = softmax of the index scores over the same
set; dense phase or ``dsa_indexer_use_sparse_loss=False``: all visible entries, else the selected top-k). The loss,
times ``dsa_indexer_loss_coeff``, is attached to the output with :class:`~dsv4_attention.indexer_loss.IndexerLossAutoScaler`
(also when the coefficient is 0, so the indexer parameters always receive a gradient) and saved to the tracker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from dsv4_attention._kernels import (
    attention_indices,
    indexer_loss,
    sparse_attn,
    visible_compressed_indices,
    window_indices,
)
from dsv4_attention.config import LAYER_KINDS, check_compress_ratio
from dsv4_attention.layout import TokenLayout
from dsv4_primitives import KeepFP32Mixin, RopeConfig, mark_keep_in_fp32


@dataclass
class CompressedSparseAttentionSubmodules:
    """Submodules of :class:`CompressedSparseAttention` (``None`` where the layer kind has none)."""

    compressor: Any = None
    indexer: Any = None


class CompressedSparseAttention(KeepFP32Mixin, MegatronModule):
    """Window / HCA / CSA core attention with a per-head fp32 sink (``attn_sink [n_h]``).

    Args:
        config: :class:`~dsv4_attention.config.DSv4AttentionConfig`.
        submodules: :class:`CompressedSparseAttentionSubmodules` (compressor needed for ratio 4/128, indexer for 4).
        compress_ratio: 0, 4 or 128.
        rope_cfg: the layer's rotary table (shared by compressor and indexer).
        pg_collection: explicit process groups.
    """

    def __init__(
        self,
        config,
        submodules: CompressedSparseAttentionSubmodules,
        compress_ratio: int,
        rope_cfg: RopeConfig,
        pg_collection,
    ) -> None:
        super().__init__(config=config)
        self.compress_ratio = check_compress_ratio(compress_ratio)
        self.kind = LAYER_KINDS[self.compress_ratio]
        self.window = config.csa_window_size
        self.head_dim = config.v_head_dim
        self.num_heads = config.num_attention_heads
        self.softmax_scale = self.head_dim**-0.5
        self.compressor = None
        self.indexer = None
        if self.compress_ratio:
            if submodules.compressor is None:
                raise ValueError(f"compress_ratio={compress_ratio} needs a compressor submodule in the spec")
            self.compressor = build_module(
                submodules.compressor,
                config=config,
                compress_ratio=self.compress_ratio,
                head_dim=self.head_dim,
                rope_cfg=rope_cfg,
                pg_collection=pg_collection,
            )
        if self.compress_ratio == 4:
            if submodules.indexer is None:
                raise ValueError("compress_ratio=4 (CSA) needs an indexer submodule in the spec")
            self.indexer = build_module(
                submodules.indexer, config=config, rope_cfg=rope_cfg, pg_collection=pg_collection
            )
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        if torch.get_default_device().type == "meta":
            device = "meta"
        self.attn_sink = torch.nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32, device=device))
        mark_keep_in_fp32(self.attn_sink)

    @property
    def backend(self) -> str:
        return self.config.csa_kernel_backend

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        layout: TokenLayout,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend.

        Args:
            q: ``[T, n_h, c]`` rotated, normalised queries.
            kv: ``[T, c]`` rotated shared key/value rows.
            x: ``[T, d]`` block input (compressor and indexer input).
            q_latent: ``[T, d_c]`` query latent ``cQ`` (indexer input).
            layout: token layout (segments, positions, padding rows).
        Returns:
            ``o [T, n_h, c]`` (before the inverse RoPE) and the indexer loss (scalar, times the coefficient) or
            ``None`` when no loss is computed (not CSA, eval mode or grad disabled).
        """
        t = q.shape[0]
        cu = layout.cu_seqlens
        # host copies of the boundaries, and indices built here from them: the kernels skip their device-to-host
        # validation reads (one synchronisation per op otherwise)
        host = layout.bounds_host
        backend = self.backend
        win = window_indices(cu, self.window, cu_seqlens_host=host)  # [T, W]
        if not self.compress_ratio:
            o, _ = sparse_attn(
                q, kv, self.attn_sink, win, self.softmax_scale, backend=backend, check_indices=False
            )
            return o, None
        entries, cu_c = self.compressor(
            x,
            cu,
            backend=backend,
            position_offset=layout.position_offset,
            max_position=layout.max_rope_position,
            cu_seqlens_host=host,
        )  # [Tc, c]
        kv_all = torch.cat((kv, entries.to(kv.dtype)), 0)  # [T + Tc, c]
        max_c = layout.max_compressed_entries(self.compress_ratio)  # host int: no device sync
        dense = self.indexer is None or self.config.csa_dense_mode
        want_loss = self.indexer is not None and self.training and torch.is_grad_enabled()
        state = topk_scores = None
        if self.indexer is not None:
            state = self.indexer(
                x,
                q_latent,
                layout.rope_positions,
                cu,
                backend=backend,
                position_offset=layout.position_offset,
                max_position=layout.max_rope_position,
                cu_seqlens_host=host,
            )
        if dense:
            comp = self._visible(layout, cu_c, max_c)  # [T, max_c]
        else:
            with torch.set_grad_enabled(want_loss):
                comp, topk_scores = self.indexer.select(
                    state, cu, backend=backend, cu_seqlens_host=host
                )  # [T, k]
        idx = attention_indices(win, comp, t)  # [T, W + K] rows of kv_all
        o, lse = sparse_attn(
            q, kv_all, self.attn_sink, idx, self.softmax_scale, backend=backend, check_indices=False
        )
        loss = None
        if want_loss:
            loss = self._indexer_loss(
                q, kv_all, lse, comp, topk_scores, state, cu, cu_c, max_c, layout, dense
            )
        return o, loss

    def _indexer_loss(
        self, q, kv_all, lse, comp, topk_scores, state, cu, cu_c, max_c, layout, dense
    ) -> torch.Tensor:
        """KL(teacher || softmax(index scores)) over the loss set, mean over real rows with entries, x coeff.

        Loss set: every visible entry (dense phase, or ``dsa_indexer_use_sparse_loss=False``), else the selected
        top-k. The student logits come from ``indexer_scores`` (column = local entry, aligned with
        ``visible_compressed_indices``) or are the top-k scores themselves.
        """
        t = q.shape[0]
        backend = self.backend
        if dense or not self.config.dsa_indexer_use_sparse_loss:
            loss_set = comp if dense else self._visible(layout, cu_c, max_c)
            student = self.indexer.scores(
                state, cu, max_c, backend=backend, cu_seqlens_host=layout.bounds_host
            )  # [T, max_c]
        else:
            loss_set, student = comp, topk_scores  # [T, k]
        valid = loss_set >= 0
        student = torch.where(valid, student, torch.zeros_like(student))
        teacher_idx = attention_indices(loss_set[:, :0], loss_set, t)  # rows of kv_all, -1 kept
        _, per_row = indexer_loss(
            q.detach(),
            kv_all.detach(),
            self.attn_sink.detach(),
            lse.detach(),
            teacher_idx,
            student,
            self.softmax_scale,
            backend=backend,
            check_indices=False,
        )
        rows = valid.any(-1)
        if layout.real_rows is not None:
            rows = rows & layout.real_rows
        kl = torch.where(rows, per_row, torch.zeros_like(per_row)).sum() / rows.sum().clamp(min=1)
        coeff = self.config.dsa_indexer_loss_coeff or 0.0
        return kl * coeff

    def _visible(self, layout, cu_c: torch.Tensor, max_c: int) -> torch.Tensor:
        """Every visible compressed entry per query ``[T, max_c]`` (global rows, -1 padded), without a sync."""
        ratio = self.compress_ratio
        return visible_compressed_indices(
            layout.cu_seqlens,
            cu_c,
            ratio,
            max_c,
            cu_seqlens_host=layout.bounds_host,
            cu_seqlens_c_host=layout.compressed_bounds_host(ratio),
        )
