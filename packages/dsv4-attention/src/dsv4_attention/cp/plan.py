"""Per-kind index maps of one CP rank (D7): halo, extended rows, window indices, compressed-entry ownership.

For an attention kind with window ``n_win`` and compress ratio ``m`` (0 = none; ``overlap`` for ratio 4), rank
``r`` (rows ``[ls, le)``, ``L = le - ls``) needs the ``d = max(n_win - 1, d_comp)`` rows left of its slice
(``d_comp = 2m - 1`` for overlapping ratio-4 groups, ``m - 1`` for ratio 128, 0 without a compressor); rows before
global row 0 do not exist, so the halo has ``h = ls - max(ls - d, 0)`` rows. The EXTENDED rows are global
``[e0, le)``, ``e0 = ls - h``: row ``i`` of ``cat(halo, local)`` is global row ``e0 + i``.

Window: local query ``i`` (global ``g = ls + i``, segment position ``p``) has slot ``j`` = extended row
``h + i - n_win + 1 + j`` where ``p - n_win + 1 + j >= 0``, else -1 (csa-kernels ``window_indices`` order).

Compressed entries (segment ``k = [s_k, s_{k+1})``, ``n_k = floor(len_k / m)`` entries, global ids
``cu_c[k] + w`` sequence-major as at CP=1): entry ``w`` ends at row ``s_k + (w+1) m - 1`` and is OWNED by the rank
holding that row. The owners are non-decreasing in the global id, so rank ``q`` owns the contiguous ids
``[G(qL), G((q+1)L))`` with ``G(X) = sum_k clamp(floor((X - s_k) / m), 0, n_k)``; at most ``c_cap = L // m + 1``
(only the segment entering the slice from the left can contribute ``ceil`` instead of ``floor``), so every rank
pads its owned entries to ``c_cap`` rows (static shapes) and the all-gather is rank-major ``[P * c_cap, c]``;
``gather_rows[g] = owner(g) * c_cap + g - G(owner(g) L)`` maps logical id ``g`` to its gathered row.

Owned entries are pooled by the csa-kernels compressor on the extended rows, whose segments are the global ones
clipped to ``[e0, le)``; a segment clipped at ``e0`` gets ``a = (e0 - s_k) mod m`` zero rows prepended so its
kernel groups stay on the segment's global grid (the kernel's group ``v`` is global group ``v + (e0 - a - s_k) / m``).
Every owned entry lies entirely inside the extended rows (``d >= d_comp``), its previous group too when it has one,
so the kernel's first (possibly zero-padded, previous-half-empty) group of a clipped segment is never owned.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import torch

from dsv4_primitives.varlen import SeqBoundaries


@dataclass(frozen=True)
class KindPlan:
    """One rank's index maps for one attention kind (see the module docstring; tensors on the layout's device).

    Attributes:
        halo_request: ``d`` rows asked for left of every slice; halo: ``h`` rows this rank gets.
        ext_positions: int64 ``[h + L]`` RoPE positions of the extended rows.
        window: int32 ``[L, n_win]`` rows of the extended key buffer (-1 = none).
        ratio: ``m`` (0: the fields below are empty).
        align: ``a`` zero rows prepended to the extended rows for the compressor.
        ext_bounds: the segment boundaries of ``cat(zeros(a), halo, local)`` for the compressor kernel (host
            :class:`~dsv4_primitives.varlen.SeqBoundaries`).
        owned_rows: int64 ``[n_own]`` rows of the kernel's pooled output that this rank owns (global id order).
        owned_positions: int64 ``[n_own]`` RoPE positions ``w * m`` (+ offset) of the owned entries.
        capacity: ``c_cap``; num_entries: ``Tc`` (global).
        gather_rows: int64 ``[Tc]`` gathered row of every global entry id.
        entry_start: int64 ``[L]`` global id of the first entry of each local query's segment (``cu_c[k]``).
        num_visible: int64 ``[L]`` entries visible to each local query, ``floor((p+1)/m)``: its visible ids are the
            contiguous range ``[entry_start, entry_start + num_visible)`` (so no ``[L, max_c]`` map is kept).
        max_entries: ``max_c``, the largest per-segment entry count (host int; the width of :attr:`visible`).
        loss_rows: int64 scalar tensor: global count of real rows with at least one visible entry.
        bounds: host segment bounds of the global layout (for :meth:`max_visible`).
        local_start: ``ls``, the first global row of this rank.
    """

    halo_request: int
    halo: int
    ext_positions: torch.Tensor
    window: torch.Tensor
    ratio: int
    align: int = 0
    ext_bounds: SeqBoundaries | None = None
    owned_rows: torch.Tensor | None = None
    owned_positions: torch.Tensor | None = None
    capacity: int = 0
    num_entries: int = 0
    gather_rows: torch.Tensor | None = None
    entry_start: torch.Tensor | None = None
    num_visible: torch.Tensor | None = None
    max_entries: int = 0
    loss_rows: torch.Tensor | None = None
    bounds: tuple[int, ...] = ()
    local_start: int = 0

    @property
    def visible(self) -> torch.Tensor | None:
        """int32 ``[L, max_c]`` global entry ids visible to each local query (``w < floor((p+1)/m)``), -1 after.

        Built on every call (``O(L * max_c)``, not cached): only the dense phase (HCA, dense CSA, the dense indexer
        loss) needs it, as CP=1 builds its ``[T, max_c]`` map there; the sparse top-k streams over the ranges."""
        if not self.ratio:
            return None
        cols = torch.arange(self.max_entries, device=self.entry_start.device)
        ids = self.entry_start[:, None] + cols  # [L, max_c]
        return torch.where(cols < self.num_visible[:, None], ids, -1).to(torch.int32)

    def max_visible(self, lo: int, hi: int) -> int:
        """Host max of :attr:`num_visible` over local rows ``[lo, hi)`` (from the segment bounds: no device sync)."""
        g0, g1 = self.local_start + lo, self.local_start + hi
        k = max(bisect.bisect_right(self.bounds, g0) - 1, 0)
        best = 0
        while k + 1 < len(self.bounds) and self.bounds[k] < g1:
            s, e = self.bounds[k], self.bounds[k + 1]
            if e > g0:  # rows [max(s, g0), min(e, g1)) of segment k; its last one sees the most entries
                best = max(best, (min(e, g1) - s) // self.ratio)
            k += 1
        return best


def halo_rows(window: int, ratio: int, overlap: bool) -> int:
    """``d = max(n_win - 1, d_comp)``: rows a rank needs left of its slice (``d_comp`` = 7 / 127 / 0)."""
    d_comp = (2 * ratio - 1 if overlap else ratio - 1) if ratio else 0
    return max(window - 1, d_comp)


def owned_before(bounds: list[int], ratio: int, row: int) -> int:
    """``G(row)``: number of compressed entries whose last token lies before global ``row``."""
    return sum(min(max((row - s) // ratio, 0), (e - s) // ratio) for s, e in itertools.pairwise(bounds))


def build_kind_plan(cpl, window: int, ratio: int, overlap: bool) -> KindPlan:
    """The :class:`KindPlan` of ``cpl`` (a :class:`~dsv4_attention.cp.layout.ContextParallelLayout`)."""
    glob = cpl.global_layout
    dev = glob.positions.device
    big_l, ls, le = cpl.num_local_tokens, cpl.local_start, cpl.local_stop
    d = halo_rows(window, ratio, overlap)
    e0 = max(ls - d, 0)
    h = ls - e0
    pos = glob.positions[ls:le]  # [L] segment-relative (no offset)
    slots = torch.arange(window, device=dev)
    rows = torch.arange(h, h + big_l, device=dev)[:, None] - window + 1 + slots  # [L, W]
    win = torch.where(pos[:, None] - window + 1 + slots >= 0, rows, -1).to(torch.int32)
    ext_pos = glob.rope_positions[e0:le]
    if not ratio:
        return KindPlan(d, h, ext_pos, win, 0)
    bounds = list(glob.bounds.host)
    ext_bounds, owned_rows, owned_w, align = _compressor_segments(bounds, ratio, e0, ls, le)
    g = [owned_before(bounds, ratio, q * big_l) for q in range(cpl.size + 1)]
    if len(owned_rows) != g[cpl.rank + 1] - g[cpl.rank]:  # the two counts of the docstring must agree
        raise AssertionError(f"CP ownership mismatch: {len(owned_rows)} vs {g[cpl.rank + 1] - g[cpl.rank]}")
    cap = big_l // ratio + 1
    gather = torch.cat(
        [torch.arange(q * cap, q * cap + g[q + 1] - g[q], dtype=torch.int64) for q in range(cpl.size)]
    )
    cu_c = [0]
    for s, e in itertools.pairwise(bounds):
        cu_c.append(cu_c[-1] + (e - s) // ratio)
    seg = torch.searchsorted(glob.bounds.cu64, torch.arange(ls, le, device=dev), right=True) - 1
    first = torch.tensor(cu_c, dtype=torch.int64, device=dev)[seg]  # [L]
    real = glob.positions >= ratio - 1
    if glob.real_rows is not None:
        real = real & glob.real_rows
    return KindPlan(
        d,
        h,
        ext_pos,
        win,
        ratio,
        align=align,
        ext_bounds=SeqBoundaries.from_host(ext_bounds, dev),
        owned_rows=torch.tensor(owned_rows, dtype=torch.int64, device=dev),
        owned_positions=torch.tensor(owned_w, dtype=torch.int64, device=dev) * ratio + glob.position_offset,
        capacity=cap,
        num_entries=cu_c[-1],
        gather_rows=gather.to(dev),
        entry_start=first,
        num_visible=(pos + 1) // ratio,
        max_entries=glob.max_compressed_entries(ratio),
        loss_rows=real.sum(),
        bounds=tuple(bounds),
        local_start=ls,
    )


def _compressor_segments(bounds: list[int], ratio: int, e0: int, ls: int, le: int):
    """Kernel bounds over ``cat(zeros(a), rows [e0, le))``, the kernel rows / global ``w`` of the owned entries,
    and ``a``."""
    ext = [0]
    owned_rows: list[int] = []
    owned_w: list[int] = []
    align = 0
    kernel_c = 0  # kernel entries before the current segment
    for s, e in itertools.pairwise(bounds):
        lo, hi = max(s, e0), min(e, le)
        if hi <= lo:
            continue
        w_off = 0
        if s < e0:  # clipped on the left: realign its groups with zero rows (only the first segment)
            align = (e0 - s) % ratio
            w_off = (e0 - align - s) // ratio
        length = hi - lo + (align if s < e0 else 0)
        ext.append(ext[-1] + length)
        n = (e - s) // ratio
        w_lo = max(0, -(-(ls - s + 1) // ratio) - 1)  # first w with last row >= ls
        w_hi = min(n, (le - s) // ratio)  # past the last w with last row < le
        if w_hi > w_lo:
            owned_rows.extend(range(kernel_c + w_lo - w_off, kernel_c + w_hi - w_off))
            owned_w.extend(range(w_lo, w_hi))
        kernel_c += length // ratio
    return ext, owned_rows, owned_w, align
