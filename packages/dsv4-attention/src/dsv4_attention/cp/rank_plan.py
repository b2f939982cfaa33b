"""``ContextParallelPlan``: the attention plan of one CP rank (D8), what ``DSv4Attention.forward`` runs under CP > 1.

The layer's one forward (:mod:`dsv4_attention.attention_plan`) asks the plan for its rows, keys and entries; on CP
rank ``r`` (``x [L, d]`` local rows, the kind's :class:`~dsv4_attention.cp.plan.KindPlan` ``kp``):

    key_rows(x)      = exchange_halo(x)                    # [h + L, d] rows [e0, le), autograd all-gather
    start_entries    = owned entries of the compressor(s) on the key rows, ONE all-gather launched async
                       (CSA / HCA; + the indexer keys), waited for at the attention: [Tc, c] in CP=1's id order
    query_positions  = the local rows' positions; key_positions = kp.ext_positions   (global layout, no collective)
    window_indices   = kp.window                           # [L, W] rows of the extended keys
    visible_entries  = kp.visible                          # [L, max_c] global entry ids (dense phase)
    select_topk      = the streaming local top-k over each query's visible range (cp.indexer)
    dense_student    = indexer_scores_at the loss set
    loss_count       = kp.loss_rows: the GLOBAL count of real rows with a visible entry (from the global layout)

so the indexer loss a rank returns is its partial (:mod:`dsv4_primitives.cp_partial_loss`). Masked rows contribute zeros that stay connected to the indexer's parameters: every
rank's indexer gets a (possibly zero) gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4_attention.cp.compressed import PendingEntries, start_owned_entries
from dsv4_attention.cp.halo import exchange_halo
from dsv4_attention.cp.indexer import LocalIndexerQueries, scores_at, select_topk
from dsv4_attention.cp.layout import ContextParallelLayout
from dsv4_attention.cp.plan import KindPlan
from dsv4_attention.indexer import IndexerState, LightningIndexer


@dataclass(frozen=True)
class ContextParallelPlan:
    """This CP rank's plan for one attention kind (see the module docstring).

    Attributes:
        layout: this rank's :class:`~dsv4_attention.cp.layout.ContextParallelLayout` (size > 1).
        kind_plan: the kind's cached :class:`~dsv4_attention.cp.plan.KindPlan` (``layout.plan(...)``).
    """

    layout: ContextParallelLayout
    kind_plan: KindPlan
    is_parallel: bool = field(default=True, init=False)
    head_group: None = field(default=None, init=False)  # every head on every CP rank

    @property
    def group(self):
        return self.layout.group  # the CP process group

    @property
    def key_halo(self) -> int:
        return self.kind_plan.halo  # the halo's KV rows come before the local rows in the key buffer

    @property
    def local_positions(self) -> torch.Tensor:
        return self.layout.local_positions  # [L]

    @property
    def halo(self) -> int:
        return self.kind_plan.halo

    @property
    def query_positions(self) -> torch.Tensor:
        return self.layout.local_positions  # [L]

    @property
    def key_positions(self) -> torch.Tensor:
        return self.kind_plan.ext_positions  # [h + L]

    @property
    def max_position(self) -> int:
        return self.layout.global_layout.max_rope_position

    @property
    def real_rows(self) -> torch.Tensor | None:
        return self.layout.local_real_rows

    @property
    def max_entries(self) -> int:
        return self.kind_plan.max_entries

    def key_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x [L, d]`` local rows -> ``cat(halo, x) [h + L, d]`` (autograd all-gather; refuses other row counts)."""
        cpl = self.layout
        big_l = cpl.num_local_tokens
        if x.shape[0] != big_l:
            raise ValueError(
                f"context-parallel rank {cpl.rank} expects its {big_l} local rows "
                f"(T={cpl.global_layout.num_tokens} / CP={cpl.size}), got x with {x.shape[0]} rows"
            )
        kp = self.kind_plan
        return exchange_halo(x, kp.halo_request, kp.halo, cpl)

    def kv_input(self, x_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x_keys, self.kind_plan.ext_positions  # the KV head of the halo rows too

    def gather_latent_kv(self, q_lat: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q_lat, kv

    def reduce_output(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def window_indices(self) -> torch.Tensor:
        return self.kind_plan.window  # [L, W]

    def visible_entries(self) -> torch.Tensor:
        return self.kind_plan.visible  # [L, max_c]

    def start_entries(self, core, x_keys: torch.Tensor) -> GatheredEntries:
        """Pool this rank's owned entries (and a CSA layer's indexer keys, on the detached rows as at CP=1) and
        launch their one all-gather: it overlaps the query / key projections that follow."""
        parts = [(core.compressor, x_keys)]
        if core.indexer is not None:
            parts.append((core.indexer.compressor, x_keys.detach()))
        pending = start_owned_entries(parts, self.kind_plan, self.layout, self.max_position, core.backend)
        return GatheredEntries(pending, core.indexer, self)

    def select_topk(
        self, indexer: LightningIndexer, state: IndexerState, backend: str, with_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Streaming top-k of the local queries over their visible ranges (``lower_index`` ties only)."""
        iq = LocalIndexerQueries(state.q, state.weights)
        return select_topk(indexer, iq, state.k, self.kind_plan, backend, with_grad)  # [L, k]

    def dense_student(
        self, indexer: LightningIndexer, state: IndexerState, loss_set: torch.Tensor, backend: str
    ) -> torch.Tensor:
        """Differentiable index scores at the loss set's global entry ids ``[L, K]``."""
        return scores_at(LocalIndexerQueries(state.q, state.weights), state.k, loss_set, backend)

    def loss_count(self, rows: torch.Tensor) -> torch.Tensor:
        """The global count of indexer-loss rows (every rank computes it from the global layout)."""
        return self.kind_plan.loss_rows


@dataclass
class GatheredEntries:
    """The in-flight all-gather of one layer's owned entries (main KV entries, then the indexer keys)."""

    pending: PendingEntries
    indexer: LightningIndexer | None
    plan: ContextParallelPlan
    _gathered: tuple[torch.Tensor, ...] | None = None

    def _wait(self) -> tuple[torch.Tensor, ...]:
        if self._gathered is None:
            self._gathered = self.pending.wait()  # ([Tc, c], [Tc, c_I] for CSA)
        return self._gathered

    def compressed(self, x_keys: torch.Tensor) -> torch.Tensor:
        return self._wait()[0]  # [Tc, c]

    def indexer_state(self, x: torch.Tensor, q_latent: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, w = self.indexer.queries(x, q_latent, self.plan.query_positions, self.plan.max_position)
        return q, self._wait()[1], w
