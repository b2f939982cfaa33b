"""``TensorParallelPlan``: the attention plan of one TP rank under sequence parallelism (issue 31).

The layer's one forward (:mod:`dsv4_attention.attention_plan`) on TP rank ``r`` of ``P`` (``x [L, d]`` = its
sequence-parallel rows ``[r*L, (r+1)*L)`` of the global pack of ``T`` rows) composes two plans:

* the SEQUENCE plan (:attr:`seq`, a :class:`~dsv4_attention.cp.rank_plan.ContextParallelPlan` over the TP group)
  for the token-local half, weights replicated: the halo, ``q_down`` + ``q_layernorm``, the shared KV head, the
  compressors (owned entries, one all-gather of entries + indexer keys in CP=1's id order), the whole lightning
  indexer on this rank's rows (queries, streaming top-k with the ``lower_index`` tie rule, the student), the
  indexer-loss count;
* the HEAD plan (:attr:`head`) for the head-split half: this rank's ``n_h / P`` heads of the head rows (window
  indices, visible entries, query positions, the key rows before them). TP only: the single-rank plan of the
  global layout (ALL ``T`` rows, no key halo). TP x CP (:func:`~dsv4_attention.tp.layout.tensor_context_parallel_layout`:
  the sequence plan is over the TP x CP group): this CP rank's
  :class:`~dsv4_attention.cp.rank_plan.ContextParallelPlan` over the CP group (the ``N = P*L`` rows of its CP
  chunk, the window's KV halo before them).

Between them (autograd, :mod:`dsv4_attention.tp.comm`):

    q_lat, kv    = gather_latent_kv(q_lat [L, d_c], kv [L, c])     # ONE all-gather -> [N, d_c], [N, c]
                   (TP x CP: + the head plan's halo exchange of the KV rows over CP -> kv [h + N, c])
    top-k ids    = gather_ids(seq top-k [L, k])                     # [N, k] int32 (no autograd)
    teacher      = logsumexp over ranks of the head-partial log-mass, this rank's rows (one all-to-all)
    y            = reduce_output(wo_b(wo_a(o)) [N, d])              # reduce-scatter -> [L, d]

(``N = T`` under TP only.) The compressed entries and indexer keys come from the sequence plan: all ``Tc`` of the
global layout in CP=1's id order, which is the head plan's entry-id space too.

The backward of each is its transpose (reduce-scatter of the latent / KV gradient, all-gather of the output
gradient). The indexer loss a rank returns is its partial over its own rows (the global count): the TP ranks'
partials add up to the TP=1 loss, and the replicated weights' gradients summed over TP are TP=1's (megatron sums
them for parameters marked ``sequence_parallel``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4_attention.cp.rank_plan import ContextParallelPlan
from dsv4_attention.indexer import IndexerState, LightningIndexer
from dsv4_attention.tp.comm import gather_ids, gather_rows, reduce_scatter_rows
from dsv4_attention.tp.layout import TensorParallelLayout


@dataclass(frozen=True)
class TensorParallelPlan:
    """This TP rank's plan for one attention kind (module docstring).

    Attributes:
        layout: the rank's :class:`~dsv4_attention.tp.layout.TensorParallelLayout` (size > 1).
        seq: the sequence plan (token-local half); head: the head half's plan (module docstring: a
            ``SingleRankPlan`` of the global layout, or under TP x CP this CP rank's ``ContextParallelPlan``).
    """

    layout: TensorParallelLayout
    seq: ContextParallelPlan
    head: object  # SingleRankPlan (TP only) | ContextParallelPlan over the CP group (TP x CP)
    is_parallel: bool = field(default=True, init=False)

    @property
    def group(self):
        return self.layout.group  # the TP process group

    @property
    def head_group(self):
        """The group the heads are split over (the indexer teacher sums over it)."""
        return self.layout.group

    @property
    def halo(self) -> int:
        return self.seq.halo  # rows before the local rows in key_rows(x)

    @property
    def key_halo(self) -> int:
        return self.head.key_halo  # KV rows before the head rows in the attention's key buffer (TP only: 0)

    @property
    def head_rows(self) -> slice:
        return self.layout.head_rows  # this rank's rows among the head plan's query rows

    @property
    def query_positions(self) -> torch.Tensor:
        return self.head.query_positions  # [N]: the attention's query rows are the head rows

    @property
    def local_positions(self) -> torch.Tensor:
        return self.seq.query_positions  # [L]

    @property
    def max_position(self) -> int:
        return self.head.max_position

    @property
    def real_rows(self) -> torch.Tensor | None:
        return self.seq.real_rows  # [L]: the indexer loss counts this rank's rows

    @property
    def max_entries(self) -> int:
        return self.head.max_entries

    def key_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x [L, d]`` -> ``cat(halo, x) [h + L, d]`` over the TP group (what the compressors read)."""
        return self.seq.key_rows(x)

    def kv_input(self, x_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared KV head runs on this rank's own rows (the gather brings the others)."""
        h = self.seq.halo
        return (x_keys[h:] if h else x_keys), self.seq.query_positions

    def gather_latent_kv(self, q_lat: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q_lat [L, d_c]``, ``kv [L, c]`` -> ``[N, d_c]``, ``[h + N, c]``: one all-gather of their concatenation
        over TP, then the head plan's key rows of the KV (TP x CP: its halo exchange over CP; TP only: identity)."""
        if q_lat.dtype != kv.dtype:
            return gather_rows(q_lat, self.group), self.head.key_rows(gather_rows(kv, self.group))
        both = gather_rows(torch.cat((q_lat, kv), 1), self.group)  # [N, d_c + c]
        return both[:, : q_lat.shape[1]], self.head.key_rows(both[:, q_lat.shape[1] :])

    def reduce_output(self, y: torch.Tensor) -> torch.Tensor:
        """``y [N, d]`` (this rank's heads' partial) -> ``[L, d]`` summed over the TP ranks."""
        return reduce_scatter_rows(y, self.group)

    def window_indices(self) -> torch.Tensor:
        return self.head.window_indices()  # [N, W] rows of the key buffer [h + N]

    def visible_entries(self) -> torch.Tensor:
        return self.head.visible_entries()  # [N, max_c]

    def start_entries(self, core, x_keys: torch.Tensor):
        return self.seq.start_entries(core, x_keys)

    def select_topk(
        self, indexer: LightningIndexer, state: IndexerState, backend: str, with_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [N, k] of every head row, scores [L, k] of this rank's rows)``: the sequence plan's top-k of the local
        rows (all indexer heads on this rank: TP=1's arithmetic and tie rule), ids all-gathered."""
        idx, scores = self.seq.select_topk(indexer, state, backend, with_grad)  # [L, k]
        return gather_ids(idx, self.group), scores

    def dense_student(
        self, indexer: LightningIndexer, state: IndexerState, loss_set: torch.Tensor, backend: str
    ) -> torch.Tensor:
        """Index scores ``[L, K]`` of this rank's rows at their slice of ``loss_set [N, K]``."""
        return self.seq.dense_student(indexer, state, loss_set[self.head_rows], backend)

    def loss_count(self, rows: torch.Tensor) -> torch.Tensor:
        return self.seq.loss_count(rows)  # the global count (every rank computes it from the global layout)
