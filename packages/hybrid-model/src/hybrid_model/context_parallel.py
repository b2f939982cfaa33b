"""Static contiguous context parallelism (CP) in the model: the group and the loss reductions.

Layout (upstream §4.2 "contiguous", shared with dsv4-attention): CP rank ``r`` of ``P`` holds the rows
``[r·L, (r+1)·L)`` of one DP replica's global THD pack of ``T = P·L`` rows; every CP rank gets the *global*
``PackedSeqParams``. A loss over tokens is computed per rank as a *partial*

    partial_r = Σ_{t in rank r} loss_t · m_t  /  Σ_{all ranks} m_t          (m: the loss mask)

so that ``Σ_r partial_r`` is the CP=1 loss. megatron's DDP averages gradients over DP x CP and its schedule
multiplies the main loss (and the MoE / attention auxiliary losses) by ``P``: the gradient of the partials then
equals the CP=1 gradient. The MTP loss, which megatron does not scale, is scaled by ``P`` in the model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def context_parallel_group(pg_collection) -> dist.ProcessGroup | None:
    """The context-parallel group of ``pg_collection`` when it has more than one rank, else ``None`` (the plain
    single-rank path everywhere)."""
    cp = getattr(pg_collection, "cp", None)
    return cp if cp is not None and cp.size() > 1 else None


def cp_token_count(mask: torch.Tensor, cp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """``Σ mask`` (fp32 scalar, no gradient) over this rank's rows, summed over ``cp_group`` when given: the
    denominator of a CP partial loss (module docstring)."""
    num = mask.detach().float().sum()
    if cp_group is not None:
        dist.all_reduce(num, group=cp_group)
    return num


def cp_partial_mean(
    per_token: torch.Tensor, mask: torch.Tensor, cp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``Σ per_token·mask / max(1, Σ_CP mask)``: the masked mean at CP=1, this rank's partial under CP (the CP
    ranks' partials add up to the masked mean over the whole pack). Differentiable through ``per_token``."""
    num = cp_token_count(mask, cp_group).clamp(min=1.0)
    return (per_token.float() * mask.float()).sum() / num


__all__ = ["context_parallel_group", "cp_partial_mean", "cp_token_count"]
