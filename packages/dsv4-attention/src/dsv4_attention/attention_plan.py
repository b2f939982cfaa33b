"""The attention plan: where one rank's query rows sit in the global pack and where its keys and entries come from.

``DSv4Attention.forward`` runs ONE forward for every layout; the layout decides only its plan
(:func:`attention_plan`):

    x_keys = plan.key_rows(x)                         # [h + L, d]  halo + own rows (trivial plan: x, h = 0)
    q      = query path on x_keys[h:]                 # [L, n_h, c] RoPE at plan.query_positions
    kv     = key path on x_keys                       # [h + L, c]  RoPE at plan.key_positions
    E      = plan.start_entries(core, x_keys)         # compressed entries (+ indexer keys) in CP=1's id order
    idx    = cat(plan.window_indices(), visible / top-k entries)    # plan.visible_entries / plan.select_topk
    o, lse = sparse_attn(q, cat(kv, E), sink, idx); indexer KL; partial_loss(sum, plan.loss_count(rows))

* :class:`SingleRankPlan` (the trivial plan; a :class:`~dsv4_attention.layout.TokenLayout`, or a
  ``ContextParallelLayout`` of size 1): no communication, identity maps (query rows = key rows = the layout's rows,
  the layer's own compressors on them, csa-kernels' index builders and top-k on the layout's boundaries, host or
  static), the loss count is the local one. Selective recompute regions apply.
* :class:`~dsv4_attention.cp.rank_plan.ContextParallelPlan` (a ``ContextParallelLayout`` of size ``P > 1``): the
  halo exchange, owned entries + one async all-gather, the kind's index maps, the streaming local top-k, the global
  valid-row count (:mod:`dsv4_attention.cp`).

Every plan implements :class:`AttentionPlan`; the indexer loss of either is a partial
(:mod:`dsv4_primitives.cp_partial_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from dsv4_attention._kernels import visible_compressed_indices, window_indices
from dsv4_attention.cp.layout import ContextParallelLayout
from dsv4_attention.cp.rank_plan import ContextParallelPlan
from dsv4_attention.indexer import IndexerState, LightningIndexer
from dsv4_attention.kind import LayerKind
from dsv4_attention.layout import TokenLayout
from dsv4_attention.tp.layout import TensorParallelLayout
from dsv4_attention.tp.plan import TensorParallelPlan


class Entries(Protocol):
    """Compressed entries and indexer keys of one layer forward, in CP=1's entry-id order."""

    def compressed(self, x_keys: torch.Tensor) -> torch.Tensor:
        """The KV compressor's entries ``[Tc, c]`` (the ``compressor`` recompute region on the trivial plan)."""
        ...

    def indexer_state(self, x: torch.Tensor, q_latent: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(q [L, n_I, c_I], keys [Tc, c_I], weights [L, n_I])`` of the query rows ``x`` / ``q_latent`` (the
        ``indexer`` recompute region on the trivial plan)."""
        ...


class AttentionPlan(Protocol):
    """One rank's plan for one attention kind (module docstring). ``L`` query rows, ``h`` halo rows before them."""

    halo: int
    is_parallel: bool

    @property
    def group(self): ...  # the CP process group (None: the trivial plan)

    @property
    def query_positions(self) -> torch.Tensor: ...  # int64 [L] RoPE positions of the query rows

    @property
    def key_positions(self) -> torch.Tensor: ...  # int64 [h + L] RoPE positions of the key rows

    @property
    def max_position(self) -> int: ...  # host bound of every RoPE position

    @property
    def real_rows(self) -> torch.Tensor | None: ...  # bool [L] (False on padding rows) or None

    @property
    def max_entries(self) -> int: ...  # max_c: width of the visible-entry map

    @property
    def key_halo(self) -> int: ...  # token rows of the attention's key buffer before its query rows

    @property
    def head_group(self): ...  # the group the heads are split over (tensor parallelism), else None

    @property
    def local_positions(self) -> torch.Tensor: ...  # int64 [L] RoPE positions of this rank's own rows

    def key_rows(self, x: torch.Tensor) -> torch.Tensor: ...  # [L, d] -> [h + L, d]

    def kv_input(
        self, x_keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # KV-head rows, positions

    def gather_latent_kv(
        self, q_lat: torch.Tensor, kv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # the attention's query latents and key rows

    def reduce_output(
        self, y: torch.Tensor
    ) -> torch.Tensor: ...  # the attention's [rows, d] -> this rank's rows

    def window_indices(self) -> torch.Tensor: ...  # int32 [L, n_win] rows of the key buffer, -1 = none

    def visible_entries(self) -> torch.Tensor: ...  # int32 [L, max_c] visible entry ids, -1 after

    def start_entries(self, core, x_keys: torch.Tensor) -> Entries: ...

    def select_topk(
        self, indexer: LightningIndexer, state: IndexerState, backend: str, with_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # (ids [L, k] int32, scores [L, k])

    def dense_student(
        self, indexer: LightningIndexer, state: IndexerState, loss_set: torch.Tensor, backend: str
    ) -> torch.Tensor: ...  # [L, max_c] index scores aligned with visible_entries()

    def loss_count(self, rows: torch.Tensor) -> torch.Tensor: ...  # global count of the indexer-loss rows


@dataclass(frozen=True)
class SingleRankPlan:
    """The trivial plan: one rank holds every row of ``layout`` (no communication, identity maps).

    Attributes:
        layout: the token layout (host or static boundaries).
        window: ``n_win``; ratio: the compress ratio ``m`` (0: none).
    """

    layout: TokenLayout
    window: int
    ratio: int
    halo: int = field(default=0, init=False)
    key_halo: int = field(default=0, init=False)
    is_parallel: bool = field(default=False, init=False)
    group: None = field(default=None, init=False)
    head_group: None = field(default=None, init=False)

    @property
    def query_positions(self) -> torch.Tensor:
        return self.layout.rope_positions

    @property
    def key_positions(self) -> torch.Tensor:
        return self.layout.rope_positions

    @property
    def local_positions(self) -> torch.Tensor:
        return self.layout.rope_positions

    @property
    def max_position(self) -> int:
        return self.layout.max_rope_position

    @property
    def real_rows(self) -> torch.Tensor | None:
        return self.layout.real_rows

    @property
    def max_entries(self) -> int:
        """``max_c`` as a host int (a capacity on a static layout): no device sync."""
        return self.layout.max_compressed_entries(self.ratio)

    def key_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def kv_input(self, x_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x_keys, self.layout.rope_positions

    def gather_latent_kv(self, q_lat: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q_lat, kv

    def reduce_output(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def window_indices(self) -> torch.Tensor:
        return window_indices(self.layout.bounds, self.window)  # [T, W]

    def visible_entries(self) -> torch.Tensor:
        return visible_compressed_indices(self.layout.bounds, self.ratio, self.max_entries)  # [T, max_c]

    def start_entries(self, core, x_keys: torch.Tensor) -> LayerEntries:
        return LayerEntries(core, self.layout)

    def select_topk(
        self, indexer: LightningIndexer, state: IndexerState, backend: str, with_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """csa-kernels' top-k over the layout's boundaries (``with_grad``: the caller's grad mode decides)."""
        return indexer.select(state, self.layout.bounds, backend=backend)  # [T, k]

    def dense_student(
        self, indexer: LightningIndexer, state: IndexerState, loss_set: torch.Tensor, backend: str
    ) -> torch.Tensor:
        """``indexer_scores`` over each row's document entries (column = local entry id, as ``loss_set``)."""
        return indexer.scores(state, self.layout.bounds, self.max_entries, backend=backend)  # [T, max_c]

    def loss_count(self, rows: torch.Tensor) -> torch.Tensor:
        """The counted rows themselves: every row is this rank's."""
        return rows.sum()


@dataclass(frozen=True)
class LayerEntries:
    """The trivial plan's entries: the layer's own compressors on its rows, run when the core asks for them (inside
    its recompute regions)."""

    core: object
    layout: TokenLayout

    def compressed(self, x_keys: torch.Tensor) -> torch.Tensor:
        layout = self.layout
        entries, _ = self.core.compressor(
            x_keys,
            layout.bounds,
            backend=self.core.backend,
            position_offset=layout.position_offset,
            max_position=layout.max_rope_position,
        )
        return entries  # [Tc, c]

    def indexer_state(self, x: torch.Tensor, q_latent: torch.Tensor) -> tuple[torch.Tensor, ...]:
        layout = self.layout
        st = self.core.indexer(
            x,
            q_latent,
            layout.rope_positions,
            layout.bounds,
            backend=self.core.backend,
            position_offset=layout.position_offset,
            max_position=layout.max_rope_position,
        )
        return st.q, st.k, st.weights


def attention_plan(
    layout: TokenLayout | ContextParallelLayout | TensorParallelLayout | AttentionPlan,
    kind: LayerKind,
    window: int,
) -> AttentionPlan:
    """The plan of one layer kind (window ``n_win``) on ``layout``: the trivial :class:`SingleRankPlan` for a
    :class:`~dsv4_attention.layout.TokenLayout` or a single-rank ``ContextParallelLayout`` /
    ``TensorParallelLayout`` (its global layout), else this rank's
    :class:`~dsv4_attention.cp.rank_plan.ContextParallelPlan` (its index maps cached on the layout) or
    :class:`~dsv4_attention.tp.plan.TensorParallelPlan` (its head plan: the single-rank plan of the global layout,
    or under TP x CP the CP plan of the layout's ``context``). A plan is returned as it is."""
    if isinstance(layout, SingleRankPlan | ContextParallelPlan | TensorParallelPlan):
        return layout
    if isinstance(layout, TensorParallelLayout):
        # the head half: the global layout (TP only) or this CP rank's chunk (TP x CP)
        head = attention_plan(
            layout.global_layout if layout.context is None else layout.context, kind, window
        )
        if not layout.is_parallel:
            return head
        seq = layout.sequence
        return TensorParallelPlan(
            layout, ContextParallelPlan(seq, seq.plan(window, kind.compress_ratio, kind.overlap)), head
        )
    if isinstance(layout, ContextParallelLayout):
        if layout.is_parallel:
            return ContextParallelPlan(layout, layout.plan(window, kind.compress_ratio, kind.overlap))
        layout = layout.global_layout
    return SingleRankPlan(layout, window, kind.compress_ratio)
