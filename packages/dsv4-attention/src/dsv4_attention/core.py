"""Core attention of one DSv4 layer: window + compressed entries + sink in one softmax (spec §2.2, §3.4, §4, §5).

``CompressedSparseAttention`` covers the three layer kinds (:class:`~dsv4_attention.kind.LayerKind`):

* ``WINDOW``, sliding-window attention: keys = the last ``n_win`` raw tokens of the document (incl. the query);
* ``HCA``, heavily compressed attention: window + every visible compressed entry (``w < floor((t+1)/128)``);
* ``CSA``, compressed sparse attention: window + the lightning indexer's top-k visible entries (sparse phase)
  or every visible entry (dense phase, ``forward(..., dense=True)``).

Shared-KV MQA (K = V = ``kv_all = cat(kv [T, c], entries [Tc, c])``), per-head fp32 sink logit used raw:

    p[h,t,j] = exp(z[h,t,j]) / (sum_j' exp(z[h,t,j']) + exp(attn_sink[h])),  z = <q[t,h], K_j> / sqrt(c)
    o[t,h]   = sum_j p[h,t,j] K_j

CSA layers also compute the indexer KL loss (§5.2; teacher = the main attention's probabilities under its full
denominator, summed over heads, L1-normalised over the loss set; student = softmax of the index scores over the same
set; dense phase or ``use_sparse_loss=False``: all visible entries, else the selected top-k), returned times the
``indexer_loss_coeff`` argument. The phase (``dense``) and the loss weight are arguments of ``forward``, not config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from dsv4_attention._kernels import attention_indices, sparse_attn, visible_compressed_indices, window_indices
from dsv4_attention.compressor import Compressor
from dsv4_attention.indexer import IndexerState, LightningIndexer
from dsv4_attention.indexer_kl import indexer_kl_sum
from dsv4_attention.kind import LayerKind
from dsv4_attention.layout import TokenLayout
from dsv4_primitives import KeepFP32Mixin, mark_keep_in_fp32
from dsv4_primitives.recompute import NO_RECOMPUTE, RecomputeConfig, checkpoint_region

BACKENDS = ("auto", "triton", "reference")


@dataclass(frozen=True)
class CoreAttentionConfig:
    """One core attention.

    Attributes:
        kind: the layer kind (ratio, compressor overlap and indexer follow from it).
        num_heads, head_dim: ``n_h``, ``c``.
        window: ``n_win`` raw tokens per query (incl. itself).
        backend: csa-kernels ``backend`` (``auto``: Triton on CUDA, the reference on CPU).
        use_sparse_loss: sparse phase KL over the selected top-k (True, spec §5.2) or all visible entries (False).
    """

    kind: LayerKind
    num_heads: int
    head_dim: int
    window: int
    backend: Literal["auto", "triton", "reference"] = "auto"
    use_sparse_loss: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.kind, LayerKind):
            raise ValueError(f"CoreAttentionConfig.kind must be a LayerKind, got {self.kind!r}")
        if self.num_heads <= 0 or self.head_dim <= 0 or self.window < 1:
            raise ValueError(
                f"need num_heads, head_dim > 0 and window >= 1, got {self.num_heads}, {self.head_dim}, {self.window}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")


class CompressedSparseAttention(KeepFP32Mixin, torch.nn.Module):
    """Window / HCA / CSA core attention with a per-head fp32 sink (``attn_sink [n_h]``).

    Args:
        cfg: :class:`CoreAttentionConfig`.
        compressor: the KV :class:`Compressor` (CSA / HCA; ``None`` for window layers).
        indexer: the :class:`LightningIndexer` (CSA only).
        device: where ``attn_sink`` is created.
    """

    def __init__(
        self,
        cfg: CoreAttentionConfig,
        *,
        compressor: Compressor | None = None,
        indexer: LightningIndexer | None = None,
        device=None,
    ) -> None:
        super().__init__()
        self._init_core(cfg, compressor, indexer, device)

    def _init_core(self, cfg, compressor, indexer, device) -> None:
        kind = cfg.kind
        if (compressor is None) == kind.has_compressor:
            raise ValueError(f"a {kind.name} layer {'needs' if kind.has_compressor else 'has no'} compressor")
        if (indexer is None) == kind.has_indexer:
            raise ValueError(f"a {kind.name} layer {'needs' if kind.has_indexer else 'has no'} indexer")
        self.cfg = cfg
        self.kind = kind
        self.compress_ratio = kind.compress_ratio
        self.window = cfg.window
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_heads
        self.softmax_scale = self.head_dim**-0.5
        self.compressor = compressor
        self.indexer = indexer
        self.attn_sink = torch.nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32, device=device))
        mark_keep_in_fp32(self.attn_sink)
        self.recompute = NO_RECOMPUTE

    def set_recompute(self, recompute: RecomputeConfig) -> None:
        """Selective recompute regions of this core: ``compressor`` (the KV compressor), ``indexer`` (the lightning
        indexer's projections and compressor) and ``core_attn`` (indices, top-k, sparse attention, indexer KL); each
        keeps only its inputs and runs again in backward (:func:`dsv4_primitives.recompute.checkpoint_region`)."""
        self.recompute = recompute

    @property
    def backend(self) -> str:
        return self.cfg.backend

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        layout: TokenLayout,
        *,
        dense: bool = False,
        indexer_loss_coeff: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend.

        Args:
            q: ``[T, n_h, c]`` rotated, normalised queries.
            kv: ``[T, c]`` rotated shared key/value rows.
            x: ``[T, d]`` block input (compressor and indexer input).
            q_latent: ``[T, d_c]`` query latent ``cQ`` (indexer input).
            layout: token layout (segments, positions, padding rows).
            dense: dense phase (CSA attends every visible entry; the indexer loss runs over all of them).
            indexer_loss_coeff: weight of the returned indexer loss.
        Returns:
            ``o [T, n_h, c]`` (before the inverse RoPE) and the indexer loss (scalar, times the coefficient) or
            ``None`` when no loss is computed (not CSA, eval mode or grad disabled).
        """
        rc = self.recompute
        region = lambda name, fn, *args: checkpoint_region(fn, *args) if rc.selects(name) else fn(*args)
        if self.compressor is None:
            return region("core_attn", lambda qq, kk: self._attend(qq, kk, layout, dense, False, 1.0), q, kv)
        entries = region("compressor", self._compress, x, layout)  # [Tc, c]
        kv_all = torch.cat((kv, entries.to(kv.dtype)), 0)  # [T + Tc, c]
        want_loss = self.indexer is not None and self.training and torch.is_grad_enabled()
        state = None
        if self.indexer is not None:
            state = IndexerState(*region("indexer", self._index, x, q_latent, layout))
        args = (q, kv_all) + ((state.q, state.k, state.weights) if state else ())

        def attend(qq, kk, *st):
            s = IndexerState(*st) if st else None
            return self._attend(qq, kk, layout, dense, want_loss, indexer_loss_coeff, s)

        return region("core_attn", attend, *args)

    def _compress(self, x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """The KV compressor's entries ``[Tc, c]`` (the ``compressor`` recompute region; their boundaries are
        ``layout.bounds.compressed(ratio)``)."""
        entries, _ = self.compressor(
            x,
            layout.bounds,
            backend=self.backend,
            position_offset=layout.position_offset,
            max_position=layout.max_rope_position,
        )
        return entries

    def _index(self, x: torch.Tensor, q_latent: torch.Tensor, layout: TokenLayout) -> tuple:
        """The indexer's ``(q, k, weights)`` (the ``indexer`` recompute region)."""
        st = self.indexer(
            x,
            q_latent,
            layout.rope_positions,
            layout.bounds,
            backend=self.backend,
            position_offset=layout.position_offset,
            max_position=layout.max_rope_position,
        )
        return st.q, st.k, st.weights

    def _attend(
        self,
        q: torch.Tensor,
        kv_all: torch.Tensor,
        layout: TokenLayout,
        dense: bool,
        want_loss: bool,
        indexer_loss_coeff: float,
        state: IndexerState | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Indices, top-k, the sparse attention and the indexer KL (the ``core_attn`` recompute region).

        ``want_loss`` is decided by the caller (a recompute region runs without autograd in forward and must still
        compute the same loss value)."""
        t = q.shape[0]
        # host boundaries: every op plans from their host copy (no device-to-host read); static ones (CUDA graphs):
        # device-side plans with capacity shapes
        bounds = layout.bounds
        backend = self.backend
        win = window_indices(bounds, self.window)  # [T, W]
        if self.compressor is None:
            o, _ = sparse_attn(
                q, kv_all, self.attn_sink, win, self.softmax_scale, backend=backend, check_indices=False
            )
            return o, None
        max_c = layout.max_compressed_entries(self.compress_ratio)  # host int (a capacity if static): no sync
        dense = self.indexer is None or dense
        topk_scores = None
        if dense:
            comp = visible_compressed_indices(bounds, self.compress_ratio, max_c)  # [T, max_c]
        else:
            with torch.set_grad_enabled(want_loss and torch.is_grad_enabled()):
                comp, topk_scores = self.indexer.select(state, bounds, backend=backend)  # [T, k]
        idx = attention_indices(win, comp, t)  # [T, W + K] rows of kv_all
        o, lse = sparse_attn(
            q, kv_all, self.attn_sink, idx, self.softmax_scale, backend=backend, check_indices=False
        )
        loss = None
        if want_loss:
            kl = self._indexer_kl(q, kv_all, lse, comp, topk_scores, state, max_c, layout, dense)
            loss = kl * indexer_loss_coeff
        return o, loss

    def _indexer_kl(
        self,
        q: torch.Tensor,
        kv_all: torch.Tensor,
        lse: torch.Tensor,
        comp: torch.Tensor,
        topk_scores: torch.Tensor | None,
        state: IndexerState,
        max_c: int,
        layout: TokenLayout,
        dense: bool,
    ) -> torch.Tensor:
        """KL(teacher || softmax(index scores)) over the loss set, mean over real rows with entries.

        Loss set: every visible entry (dense phase, or ``use_sparse_loss=False``), else the selected top-k. The
        student logits come from ``indexer_scores`` (column = local entry, aligned with
        ``visible_compressed_indices``) or are the top-k scores themselves.
        """
        t = q.shape[0]
        backend = self.backend
        if dense or not self.cfg.use_sparse_loss:
            loss_set = (
                comp if dense else visible_compressed_indices(layout.bounds, self.compress_ratio, max_c)
            )
            student = self.indexer.scores(state, layout.bounds, max_c, backend=backend)  # [T, max_c]
        else:
            loss_set, student = comp, topk_scores  # [T, k]
        total, rows = indexer_kl_sum(
            q,
            kv_all,
            self.attn_sink,
            lse,
            loss_set,
            student,
            self.softmax_scale,
            t,
            layout.real_rows,
            backend,
        )
        return total / rows.sum().clamp(min=1)
