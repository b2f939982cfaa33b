"""``ContextParallelLayout``: this rank's contiguous slice of a global packed layout, and its index maps (D7).

Static contiguous CP: CP rank ``r`` of ``P`` owns global rows ``[r*L, (r+1)*L)`` of the (padded) packed buffer of
``T = P*L`` rows; every rank holds the GLOBAL :class:`~dsv4_attention.layout.TokenLayout` (segments = documents,
their padding and the static tail, exactly as at CP=1), so every index below is computed locally, on the host from
the segment bounds or on the device without a synchronisation, and no metadata is communicated.

Per attention kind (window ``n_win``, ratio ``m``, overlap) :meth:`ContextParallelLayout.plan` gives a cached
:class:`~dsv4_attention.cp.plan.KindPlan` (halo size, window indices into the extended rows, compressed-entry
ownership, the logical-id -> gathered-row map, visible-entry indices); see :mod:`dsv4_attention.cp.plan`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dsv4_attention.cp.plan import build_kind_plan
from dsv4_attention.layout import TokenLayout, thd_layout


@dataclass(frozen=True)
class ContextParallelLayout:
    """This CP rank's view of one global packed layout.

    Attributes:
        global_layout: the layout of all ``T = size * L`` rows (identical on every CP rank).
        group: the CP process group (``None`` for the single-rank path).
        rank, size: this rank's index in ``group`` and the CP size ``P``.
    """

    global_layout: TokenLayout
    group: object
    rank: int
    size: int
    _plans: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        t = self.global_layout.num_tokens
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"CP rank {self.rank} out of range for CP size {self.size}")
        if t % self.size:
            raise ValueError(
                f"the packed buffer has {t} rows, not a multiple of the context-parallel size {self.size}: pad the "
                f"pack to a multiple of {self.size} rows (static contiguous CP gives every rank T / CP rows)"
            )

    @property
    def is_parallel(self) -> bool:
        """True when the layer must run the CP path (``size > 1``)."""
        return self.size > 1

    @property
    def num_local_tokens(self) -> int:
        """``L = T / P`` rows on every rank."""
        return self.global_layout.num_tokens // self.size

    @property
    def local_start(self) -> int:
        return self.rank * self.num_local_tokens

    @property
    def local_stop(self) -> int:
        return self.local_start + self.num_local_tokens

    @property
    def local_positions(self) -> torch.Tensor:
        """int64 ``[L]`` document-relative RoPE positions of the local rows (``position_offset`` included)."""
        return self.global_layout.rope_positions[self.local_start : self.local_stop]

    @property
    def local_real_rows(self) -> torch.Tensor | None:
        """bool ``[L]`` (False on padding rows) or ``None`` when every global row is a real token."""
        real = self.global_layout.real_rows
        return None if real is None else real[self.local_start : self.local_stop]

    def plan(self, window: int, ratio: int, overlap: bool):
        """The cached :class:`~dsv4_attention.cp.plan.KindPlan` of one attention kind on this rank."""
        key = (window, ratio, overlap)
        hit = self._plans.get(key)
        if hit is None:
            hit = self._plans[key] = build_kind_plan(self, window, ratio, overlap)
        return hit


def context_parallel_layout(global_layout: TokenLayout, group) -> ContextParallelLayout:
    """This rank's :class:`ContextParallelLayout` of ``global_layout`` over the CP ``group``.

    ``group`` ``None`` or of size 1: the single-rank layout (the layer then runs its plain path on
    ``global_layout``, bitwise unchanged). ``global_layout`` must describe the whole padded pack (``T = P * L``).
    """
    if group is None or dist.get_world_size(group) == 1:
        return ContextParallelLayout(global_layout, None, 0, 1)
    return ContextParallelLayout(global_layout, group, dist.get_rank(group), dist.get_world_size(group))


_CACHE: dict[tuple[int, int], tuple] = {}


def packed_context_parallel_layout(
    hidden_states: torch.Tensor, packed_seq_params, group
) -> ContextParallelLayout:
    """The layout of a CP rank's attention input: ``hidden_states [L, 1, d]`` = this rank's rows of the GLOBAL pack
    ``packed_seq_params`` (THD, ``cu_seqlens_q[_padded]`` over ``T = P * L`` rows, identical on every CP rank).

    Reused while the global layout is (megatron passes the same ``PackedSeqParams`` to every layer of a step, and
    :func:`~dsv4_attention.layout.thd_layout` caches on it), so every layer shares one layout and its per-kind
    plans.
    """
    if packed_seq_params is not None and hasattr(packed_seq_params, "to_packed_seq_params"):
        packed_seq_params = packed_seq_params.to_packed_seq_params()
    fmt = getattr(packed_seq_params, "qkv_format", None) if packed_seq_params is not None else None
    if fmt != "thd":
        raise ValueError(
            "context parallelism in DSv4 attention needs a packed THD batch (PackedSeqParams(qkv_format='thd') "
            "describing the GLOBAL pack); SBHD [s, b, h] input is not supported with CP > 1: run [B, S] batches as "
            "a THD pack of B documents of S tokens"
        )
    if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
        raise ValueError(
            f"THD activations under CP must be this rank's rows [L, 1, h], got shape {tuple(hidden_states.shape)}"
        )
    size = dist.get_world_size(group)
    glob = thd_layout(packed_seq_params, hidden_states.shape[0] * size, hidden_states.device)
    key = (id(glob), id(group))
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is glob and hit[1] is group:
        return hit[2]
    cpl = context_parallel_layout(glob, group)
    if (
        len(_CACHE) >= 2
    ):  # the current and the previous micro-batch: plans hold [L, W] window maps and [Tc] id maps
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = (weakref.ref(glob), group, cpl)
    return cpl
