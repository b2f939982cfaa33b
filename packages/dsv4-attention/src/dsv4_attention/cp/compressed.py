"""Compressed entries under CP (D7): each rank pools the entries it owns, all ranks gather them in CP=1's order.

``start_owned_entries(compressor, x_ext, plan, cpl)`` runs the compressor's projections on ``x_ext`` and prepends
``a`` zero rows to them (= the projections of ``cat(zeros(a), x_ext)``: the linears are bias-free), pools with csa-kernels' ``compressor_pool`` on the realigned extended segments (see
:mod:`dsv4_attention.cp.plan`), keeps the owned rows, applies the norm and RoPE at the entries' global positions
``w * m``, pads them to the static capacity ``c_cap`` and launches the async all-gather (the main entries and the indexer
keys of a CSA layer in one collective). ``.wait()`` gives the
global, sequence-major entries ``[Tc, c]`` (entry id ``g`` = CP=1's id ``g``): ``gathered[gather_rows]``. The
gradient of the gathered rows is summed over ranks back to the owner (reduce-scatter), then flows through the
owner's compressor. The norm is row-wise, so applying it to the owned rows only is CP=1's math.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_attention._kernels import compressor_pool
from dsv4_attention._linears import linear_out
from dsv4_attention._rope import rope
from dsv4_attention.compressor import Compressor
from dsv4_attention.cp.comm import PendingGather, start_all_gather_rows


@dataclass
class PendingEntries:
    """Owned entries of one or more compressors in flight (ONE all-gather of their feature-concatenation);
    :meth:`wait` -> the global entries ``[Tc, c_i]`` of each, in CP=1's order."""

    pending: PendingGather
    gather_rows: torch.Tensor
    widths: tuple[int, ...]

    def wait(self) -> tuple[torch.Tensor, ...]:
        rows = self.pending.wait().index_select(0, self.gather_rows)  # [Tc, sum c_i]
        return torch.split(rows, list(self.widths), dim=1)


def owned_entries(
    compressor: Compressor, x_ext: torch.Tensor, plan, max_position: int, backend: str
) -> torch.Tensor:
    """This rank's owned entries ``[c_cap, c]`` (zero rows past the owned count) in ``x_ext.dtype``."""
    kv = linear_out(compressor.linear_wkv, x_ext)  # [h+L, coff*c]
    score = linear_out(compressor.linear_wgate, x_ext)  # [h+L, coff*c]
    if (
        plan.align
    ):  # the zero rows' projections are zero rows (the linears are bias-free): prepend those, so the
        # projections keep x_ext itself for backward, not an [a + h + L, d] zero-padded copy of it
        z = kv.new_zeros(plan.align, kv.shape[1])
        kv, score = torch.cat((z, kv), 0), torch.cat((z.to(score.dtype), score), 0)  # [a+h+L, coff*c]
    pooled, _ = compressor_pool(
        kv,
        score,
        compressor.ape,
        compressor.compress_ratio,
        compressor.overlap,
        plan.ext_bounds,
        backend=backend,
    )  # [Tc_ext, c] fp32
    own = compressor.norm(pooled.index_select(0, plan.owned_rows))  # [n_own, c]
    own = rope(own, plan.owned_positions, compressor.rope_cfg, max_position=max_position).to(x_ext.dtype)
    pad = plan.capacity - own.shape[0]
    return torch.cat((own, own.new_zeros(pad, own.shape[1])), 0) if pad else own  # [c_cap, c]


def start_owned_entries(
    parts: list[tuple[Compressor, torch.Tensor]], plan, cpl, max_position: int, backend: str
) -> PendingEntries:
    """Pool this rank's owned entries of every ``(compressor, x_ext)`` and launch ONE all-gather of them.

    One collective per layer (the main KV entries and the indexer keys side by side) also makes the backward's
    reduce-scatters a chain ordered by data dependencies (this gather, then the halo's), identical on every rank
    whatever order the autograd engine would pick between independent collectives.
    """
    owned = [owned_entries(comp, x, plan, max_position, backend) for comp, x in parts]  # [c_cap, c_i] each
    fused = owned[0] if len(owned) == 1 else torch.cat(owned, 1)  # [c_cap, sum c_i]
    widths = tuple(o.shape[1] for o in owned)
    return PendingEntries(start_all_gather_rows(fused, cpl.group), plan.gather_rows, widths)
