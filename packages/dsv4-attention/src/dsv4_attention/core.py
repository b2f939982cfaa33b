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

The rows come with an :class:`~dsv4_attention.attention_plan.AttentionPlan`: one rank's query rows, the key rows
before them (a context-parallel halo), where the compressed entries and indexer keys come from, the index maps and
the indexer-loss count. A :class:`~dsv4_attention.layout.TokenLayout` is the trivial single-rank plan; the same code
runs every plan (``T`` above is then ``L`` query rows and ``h + L`` key rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from dsv4_attention._kernels import attention_indices, sparse_attn
from dsv4_attention.attention_plan import AttentionPlan, Entries, attention_plan
from dsv4_attention.compressor import Compressor
from dsv4_attention.cp.layout import ContextParallelLayout
from dsv4_attention.indexer import IndexerState, LightningIndexer
from dsv4_attention.indexer_kl import indexer_kl_sum
from dsv4_attention.kind import LayerKind
from dsv4_attention.layout import TokenLayout
from dsv4_attention.tp.indexer_kl import tp_indexer_kl_sum
from dsv4_primitives import KeepFP32Mixin, mark_keep_in_fp32
from dsv4_primitives.cp_partial_loss import partial_loss
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
        layout: TokenLayout | AttentionPlan,
        *,
        dense: bool = False,
        indexer_loss_coeff: float = 1.0,
        entries: Entries | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend.

        Args:
            q: ``[L, n_h, c]`` rotated, normalised queries.
            kv: ``[h + L, c]`` rotated shared key/value rows (``h``: the plan's halo; 0 on one rank, ``L = T``).
            x: ``[h + L, d]`` block input of the key rows (compressor and indexer input).
            q_latent: ``[L, d_c]`` query latent ``cQ`` (indexer input).
            layout: a token layout (the trivial single-rank plan) or an
                :class:`~dsv4_attention.attention_plan.AttentionPlan` (``DSv4Attention.forward`` passes its plan).
            dense: dense phase (CSA attends every visible entry; the indexer loss runs over all of them).
            indexer_loss_coeff: weight of the returned indexer loss.
            entries: the plan's entries when already started (the layer starts them before its projections so a
                context-parallel gather overlaps them); ``None``: started here.
        Returns:
            ``o [L, n_h, c]`` (before the inverse RoPE) and the indexer loss (scalar, times the coefficient; under
            context parallelism this rank's partial) or ``None`` when no loss is computed (not CSA, eval mode or
            grad disabled).
        """
        plan = self.plan(layout)
        # selective recompute on one rank only: a region runs its forward again in backward, and under CP the
        # regions would hold collectives
        rc = NO_RECOMPUTE if plan.is_parallel else self.recompute
        region = lambda name, fn, *args: checkpoint_region(fn, *args) if rc.selects(name) else fn(*args)
        if self.compressor is None:
            return region("core_attn", lambda qq, kk: self._attend(qq, kk, plan, dense, False, 1.0), q, kv)
        if entries is None:
            entries = plan.start_entries(self, x)
        comp = region("compressor", entries.compressed, x)  # [Tc, c]
        kv_all = torch.cat((kv, comp.to(kv.dtype)), 0)  # [h + L + Tc, c]
        want_loss = self.indexer is not None and self.training and torch.is_grad_enabled()
        state = None
        if self.indexer is not None:
            x_q = x[plan.halo :] if plan.halo else x  # [L, d] the query rows (a view)
            state = IndexerState(*region("indexer", entries.indexer_state, x_q, q_latent))
        args = (q, kv_all) + ((state.q, state.k, state.weights) if state else ())

        def attend(qq, kk, *st):
            s = IndexerState(*st) if st else None
            return self._attend(qq, kk, plan, dense, want_loss, indexer_loss_coeff, s)

        return region("core_attn", attend, *args)

    def plan(self, layout: TokenLayout | ContextParallelLayout | AttentionPlan) -> AttentionPlan:
        """This core's :class:`~dsv4_attention.attention_plan.AttentionPlan` on ``layout`` (its kind and window; a
        plan is returned as it is)."""
        return attention_plan(layout, self.kind, self.window)

    def _attend(
        self,
        q: torch.Tensor,
        kv_all: torch.Tensor,
        plan: AttentionPlan,
        dense: bool,
        want_loss: bool,
        indexer_loss_coeff: float,
        state: IndexerState | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Indices, top-k, the sparse attention and the indexer KL (the ``core_attn`` recompute region).

        ``want_loss`` is decided by the caller (a recompute region runs without autograd in forward and must still
        compute the same loss value)."""
        n_keys = plan.key_halo + q.shape[0]  # token rows of kv_all (before the entries)
        # host boundaries: every op plans from their host copy (no device-to-host read); static ones (CUDA graphs):
        # device-side plans with capacity shapes
        backend = self.backend
        win = plan.window_indices()  # [L, W] rows of the key buffer
        if self.compressor is None:
            o, _ = sparse_attn(
                q, kv_all, self.attn_sink, win, self.softmax_scale, backend=backend, check_indices=False
            )
            return o, None
        dense = self.indexer is None or dense
        topk_scores = None
        if dense:
            comp = plan.visible_entries()  # [L, max_c]
        else:
            with torch.set_grad_enabled(want_loss and torch.is_grad_enabled()):
                comp, topk_scores = plan.select_topk(self.indexer, state, backend, want_loss)  # [L, k]
        idx = attention_indices(win, comp, n_keys)  # [L, W + K] rows of kv_all
        o, lse = sparse_attn(
            q, kv_all, self.attn_sink, idx, self.softmax_scale, backend=backend, check_indices=False
        )
        loss = None
        if want_loss:
            loss = (
                self._indexer_kl(q, kv_all, lse, comp, topk_scores, state, plan, dense) * indexer_loss_coeff
            )
        return o, loss

    def _indexer_kl(
        self,
        q: torch.Tensor,
        kv_all: torch.Tensor,
        lse: torch.Tensor,
        comp: torch.Tensor,
        topk_scores: torch.Tensor | None,
        state: IndexerState,
        plan: AttentionPlan,
        dense: bool,
    ) -> torch.Tensor:
        """KL(teacher || softmax(index scores)) over the loss set, summed over the counted rows, divided by the
        plan's count of them: the mean at CP=1, this rank's partial under CP (:func:`partial_loss`).

        Loss set: every visible entry (dense phase, or ``use_sparse_loss=False``), else the selected top-k. The
        student logits are the plan's dense scores (column aligned with the visible entries) or the top-k scores
        themselves. Heads split over TP (``plan.head_group``): the loss set covers every head row (all rows; TP x CP:
        the CP chunk's), the student this rank's rows (``plan.head_rows`` of them), and the teacher sums the
        head-partial log-masses over the TP ranks (:mod:`dsv4_attention.tp.indexer_kl`).
        """
        if dense or not self.cfg.use_sparse_loss:
            loss_set = comp if dense else plan.visible_entries()  # [L, max_c]
            student = plan.dense_student(self.indexer, state, loss_set, self.backend)  # [L, max_c]
        else:
            loss_set, student = comp, topk_scores  # [L, k]
        if plan.head_group is not None:  # heads split over TP: the teacher sums over every rank's heads
            total, rows = tp_indexer_kl_sum(
                q,
                kv_all,
                lse,
                loss_set,
                student,
                self.softmax_scale,
                plan.key_halo + q.shape[0],
                plan.head_rows,
                plan.real_rows,
                plan.head_group,
            )
            return partial_loss(total, plan.loss_count(rows))
        total, rows = indexer_kl_sum(
            q,
            kv_all,
            self.attn_sink,
            lse,
            loss_set,
            student,
            self.softmax_scale,
            plan.key_halo + q.shape[0],
            plan.real_rows,
            self.backend,
        )
        return partial_loss(total, plan.loss_count(rows))
